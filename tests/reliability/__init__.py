"""Soak, chaos and fuzz runs against a real server on loopback (`python -m tests.reliability`,
`make reliability`). The modules here are drivers, not pytest files; the fast CI versions are in
`tests/integration/test_reliability_quick.py`. See docs/reliability.md."""
