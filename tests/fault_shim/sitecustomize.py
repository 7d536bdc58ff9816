"""Test-only fault injection for `spindle serve` subprocesses (tests put this
directory first on PYTHONPATH). Inert unless SPINDLE_TEST_PREPARE_FAULTS is set,
as "7,7,7,7=ValueError;8,8,8,8=RuntimeError": the model state then fails to
prepare a request whose prompt starts with those token ids, raising that error."""

import os

_FAULTS = os.environ.get("SPINDLE_TEST_PREPARE_FAULTS")

if _FAULTS:
    import builtins

    from spindle.runner.model_states.base import ModelState

    _markers = []
    for _fault in _FAULTS.split(";"):
        _ids, _error = _fault.split("=")
        _markers.append(([int(t) for t in _ids.split(",")], getattr(builtins, _error)))
    _original = ModelState.preprocess_state

    def _failing_preprocess_state(self, state, new):
        for marker, error in _markers:
            if list(new.token_ids[:len(marker)]) == marker:
                raise error(f"injected failure of {new.req_id}")
        return _original(self, state, new)

    ModelState.preprocess_state = _failing_preprocess_state
