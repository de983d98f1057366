"""torch's MemTracker, as every measured peak here reads it (plan --measure, plan --pp --measure, tune).

MemTracker hooks every param's grad in each module's forward, and ``register_hook`` fails on a
frozen param ("cannot register a hook on a tensor that doesn't require gradient"): an adapter's
base weights, or a param a model keeps frozen itself (Ernie 4.5 MoE's ``e_score_correction_bias``).
A frozen param has no grad to count, so it is marked hooked already, with a handle that removes
nothing.
"""

from __future__ import annotations

from typing import Any


class _NoHook:
    @staticmethod
    def remove() -> None:
        pass


def memory_tracker(*, per_microbatch: bool = False) -> Any:
    """A MemTracker that takes frozen params. ``per_microbatch``: a module's second forward in one
    step is a new call (a pipeline stage runs once per microbatch, which MemTracker otherwise refuses);
    then only the step's global peak is meaningful, not the per-module statistics."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):  # type: ignore[override]
            for param in module.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(param, (_NoHook, _NoHook))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _pre_fw_hook(self, module, inputs):  # type: ignore[no-untyped-def]
            if per_microbatch and module in self.memory_tracking and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return Tracker()
