"""The plait language: programs, primitives and IR nodes (plain data; nothing here executes)."""

from __future__ import annotations

from plait.lang.constraints import DTYPE_REGEX, Constraint
from plait.lang.context import get_default_backend, set_default_backend
from plait.lang.ir import (
    SELECT_METHODS,
    Concat,
    Gen,
    Node,
    NodeVisitor,
    Role,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    as_node,
)
from plait.lang.primitives import (
    assistant,
    fork,
    gen,
    gen_int,
    gen_string,
    join,
    role,
    select,
    system,
    user,
)
from plait.lang.program import Program, Runner, program
from plait.lang.sampling import SamplingSpec
from plait.lang.state import StateBase
from plait.lang.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolSpec, describe_tools
from plait.lang.trace import Placeholder, Trace, TraceStop, TracingState

__all__ = [
    "DTYPE_REGEX",
    "SELECT_METHODS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Concat",
    "Constraint",
    "Gen",
    "Node",
    "NodeVisitor",
    "Placeholder",
    "Program",
    "Role",
    "RoleBegin",
    "RoleEnd",
    "Runner",
    "SamplingSpec",
    "Select",
    "StateBase",
    "Text",
    "ToolSpec",
    "Trace",
    "TraceStop",
    "TracingState",
    "as_node",
    "assistant",
    "describe_tools",
    "fork",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "join",
    "program",
    "role",
    "select",
    "set_default_backend",
    "system",
    "user",
]
