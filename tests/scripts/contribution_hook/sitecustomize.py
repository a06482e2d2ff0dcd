"""Test-only faults for the contribution checks, put on PYTHONPATH of a launch's processes (Python imports
sitecustomize at start-up); it changes nothing unless one of these is set in the environment when the hooked code
runs (read at each call, so one process can train a faulty run and then a clean one: tests/scripts/train_runs.py):

    CONTRIBUTION_HOOK_SCALE=s       this process's pseudo-gradient is multiplied by s before it is measured and sent
                                    (s = 3: a scaled contribution; s = -1: a sign flip)
    CONTRIBUTION_HOOK_LR=s          this process's inner learning rate is s times the one it was given
    CONTRIBUTION_HOOK_STEPS=k       this process reports k times the inner steps its pseudo-gradient covers (a
                                    step counter that counts micro-batches)
    CONTRIBUTION_HOOK_LEAVE_OUT=k   every replica's checks also find replica k out, from the first sync on: the run
                                    "without that replica" that a faulty run is compared with
    CONTRIBUTION_HOOK_HOLD=path     after its joining sync, this process waits for `path` to exist before its first
                                    inner step (a site that joined and then brings nothing to the next syncs)
    CONTRIBUTION_HOOK_RANK=r        only the process of global rank r (the torch backend's replica r) is hooked
"""

import os
import time


def _setting(name: str) -> str | None:
    """The hook's setting `name` when it is set and this process is the one hooked."""
    value = os.environ.get(name)
    rank = os.environ.get("RANK")
    return value if value and os.environ.get("CONTRIBUTION_HOOK_RANK", rank) == rank else None


def _hook(module) -> None:
    if module.__name__ == "hf_diloco.config":
        post_init = module.DiLoCoConfig.__post_init__

        def scaled(self):
            post_init(self)
            if _setting("CONTRIBUTION_HOOK_LR"):
                self.learning_rate *= float(_setting("CONTRIBUTION_HOOK_LR"))

        module.DiLoCoConfig.__post_init__ = scaled
    if module.__name__ == "hf_diloco.fragments":
        original = module.Fragment.pseudo_gradient

        def pseudo_gradient(self, *args, **kwargs):
            delta = original(self, *args, **kwargs)
            return delta.mul_(float(_setting("CONTRIBUTION_HOOK_SCALE"))) if _setting("CONTRIBUTION_HOOK_SCALE") \
                else delta

        module.Fragment.pseudo_gradient = pseudo_gradient
        since_base = module.since_base

        def miscounted(*args, **kwargs):
            steps, lr_sum, examples = since_base(*args, **kwargs)
            factor = float(_setting("CONTRIBUTION_HOOK_STEPS") or 1)
            return steps * factor, lr_sum * factor, examples

        module.since_base = miscounted
    if module.__name__ == "hf_diloco.engine":
        join = module.SyncEngine.join

        def held(self, step):
            start = join(self, step)
            hold = _setting("CONTRIBUTION_HOOK_HOLD")
            while hold and not os.path.exists(hold):
                time.sleep(0.05)
            return start

        module.SyncEngine.join = held
    if module.__name__ == "hf_diloco.gate":
        judge = module.judge

        def judged(rows, *args, **kwargs):
            verdicts = judge(rows, *args, **kwargs)
            left_out = _setting("CONTRIBUTION_HOOK_LEAVE_OUT")
            if left_out is not None and int(left_out) in rows:
                verdicts = {**verdicts, int(left_out): "left out by the test"}
            return verdicts

        module.judge = judged


if "RANK" in os.environ or "CONTRIBUTION_HOOK_HOLD" in os.environ:  # a process of a launch (a launch of one
    # process, such as a torchft site's, sets no RANK: the hold is given to that site alone)
    import importlib.abc
    import sys

    class _Finder(importlib.abc.MetaPathFinder):
        """Hooks hf_diloco.config, .fragments, .engine and .gate right after they are first imported."""

        def find_spec(self, name, path, target=None):
            if name not in ("hf_diloco.gate", "hf_diloco.config", "hf_diloco.fragments", "hf_diloco.engine"):
                return None
            sys.meta_path.remove(self)
            try:
                import importlib.util

                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            loader = spec.loader
            execute = loader.exec_module

            def exec_module(module):
                execute(module)
                _hook(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
