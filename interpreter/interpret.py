"""`Interpreter`: one method per IR node; runs on the state's worker thread."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.interpreter.errors import GenerationError, OutputParseError
from plait.interpreter.scoring import score_choices
from plait.interpreter.tool_loop import run_tool_loop
from plait.lang.ir import Concat, Gen, Role, RoleBegin, RoleEnd, Select, Text

if TYPE_CHECKING:
    from plait.interpreter.executor import StreamExecutor


@dataclass(frozen=True)
class GenOutput:
    text: str
    meta_info: dict[str, Any]

    @property
    def finish_reason(self) -> dict[str, Any]:
        return self.meta_info.get("finish_reason") or {}


class Interpreter:
    """Implements `plait.lang.NodeVisitor` for one `StreamExecutor`."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.ex = executor

    # text and roles -----------------------------------------------------------------------------

    def visit_text(self, node: Text) -> None:
        with self.ex.write() as d:
            d.append(node.value)

    def visit_concat(self, node: Concat) -> None:
        for part in node.parts:
            part.accept(self)

    def visit_role(self, node: Role) -> None:
        self.visit_role_begin(RoleBegin(node.role))
        for part in node.body:
            part.accept(self)
        self.visit_role_end(RoleEnd(node.role))

    def visit_role_begin(self, node: RoleBegin) -> None:
        with self.ex.write() as d:
            d.begin_role(node.role, self.ex.template)

    def visit_role_end(self, node: RoleEnd) -> None:
        with self.ex.write() as d:
            d.end_role(node.role, self.ex.template)

    # model calls ----------------------------------------------------------------------------

    def visit_gen(self, node: Gen) -> None:
        if node.tools:
            run_tool_loop(self, node)
            return
        params = node.sampling.over(self.ex.defaults).to_native()
        if params.get("token_healing") is None:
            params.pop("token_healing", None)
            if "token_healing" in self.ex.backend.features:  # on by default in programs
                params["token_healing"] = True
        elif params["token_healing"]:
            self.ex.backend.require("token_healing", needed_by=f"gen {node.name!r}")
        else:
            params.pop("token_healing")
        constraint = node.constraint
        if constraint is not None:
            native = constraint.to_native()
            self.ex.backend.require(next(iter(native)), needed_by=f"gen {node.name!r}")
            params.update(native)
        out = self.generate(node.name, params)
        if node.name is None:
            return
        value: Any = out.text
        if constraint is not None:
            try:
                value = constraint.parse(out.text)
            except ValueError as e:
                hint = (
                    " (the output was cut at max_tokens)"
                    if out.finish_reason.get("type") == "length"
                    else ""
                )
                raise OutputParseError(node.name, out.text, f"{e}{hint}") from None
        with self.ex.write() as d:
            d.set_var(node.name, value, out.meta_info, out.text)

    def generate(self, name: str | None, params: dict[str, Any]) -> GenOutput:
        """One model call on the state's text; its output is appended as it arrives."""
        ex = self.ex
        rid = uuid.uuid4().hex
        ex.track(rid)
        with ex.write() as d:
            start = len(d.text)
            if name is not None:
                d.var_texts[name] = ""
            prompt = d.text
        try:
            if ex.stream and "stream" in ex.backend.features:
                final: dict[str, Any] = {"text": "", "meta_info": {}}
                for chunk in ex.backend.generate_stream(prompt, params, rid=rid):
                    with ex.write() as d:
                        d.replace_from(start, chunk["text"], name)
                    final = chunk
                out = GenOutput(final["text"], final["meta_info"])
            else:
                result = ex.backend.generate(prompt, params, rid=rid)
                assert isinstance(result, dict)
                out = GenOutput(result["text"], result["meta_info"])
                with ex.write() as d:
                    d.append(out.text, name)
        finally:
            ex.untrack(rid)
        if out.finish_reason.get("type") == "abort":
            message = out.finish_reason.get("message") or "no reason given"
            raise GenerationError(f"gen {name!r}: the backend aborted the request: {message}")
        return out

    def visit_select(self, node: Select) -> None:
        ex = self.ex
        ex.backend.require("logprobs", needed_by=f"select {node.name!r}")
        with ex.write() as d:
            prompt = d.text
        base = uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(len(node.choices))]
        every = [*rids, f"{rids[0]}-n", *(f"{r}-u" for r in rids)]  # see score_choices
        ex.track(*every)
        try:
            result = score_choices(ex.backend, prompt, node.choices, node.method, rids)
        finally:
            ex.untrack(*every)
        with ex.write() as d:
            d.append(result.choice)
            if node.name is not None:
                d.set_var(node.name, result.choice, result.meta_info(), result.choice)
