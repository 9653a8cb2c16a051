"""Stateful operators: what a shard's state holds and how epochs fold into it. The
package imports none of them: a shard task's worker imports only its own operator's
modules (``operators/window_state.py`` alone brings pandas)."""
