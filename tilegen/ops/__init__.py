"""Ops: the user-facing functions, each validating its inputs and dispatching to a generated kernel."""
