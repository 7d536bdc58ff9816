"""Structured outputs: regexes, JSON schemas and choice lists compiled into byte DFAs that
tell, at each decode step, which continuations keep the output matching."""
