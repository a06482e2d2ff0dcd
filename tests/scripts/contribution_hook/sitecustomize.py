"""Test-only faults for the contribution checks, put on PYTHONPATH of a launch's processes (Python imports
sitecustomize at start-up); it changes nothing unless one of these is set:

    CONTRIBUTION_HOOK_SCALE=s       this process's pseudo-gradient is multiplied by s before it is measured and sent
                                    (s = 3: a scaled contribution; s = -1: a sign flip)
    CONTRIBUTION_HOOK_LR=s          this process's inner learning rate is s times the one it was given
    CONTRIBUTION_HOOK_LEAVE_OUT=k   every replica's checks also find replica k out, from the first sync on: the run
                                    "without that replica" that a faulty run is compared with
    CONTRIBUTION_HOOK_RANK=r        only the process of global rank r (the torch backend's replica r) is hooked
"""

import os

if any(os.environ.get(name) for name in ("CONTRIBUTION_HOOK_SCALE", "CONTRIBUTION_HOOK_LEAVE_OUT",
                                         "CONTRIBUTION_HOOK_LR")) and \
        os.environ.get("CONTRIBUTION_HOOK_RANK", os.environ.get("RANK")) == os.environ.get("RANK") and \
        "RANK" in os.environ:
    import importlib.abc
    import sys

    def _hook(module) -> None:
        if module.__name__ == "hf_diloco.config" and os.environ.get("CONTRIBUTION_HOOK_LR"):
            factor = float(os.environ["CONTRIBUTION_HOOK_LR"])
            post_init = module.DiLoCoConfig.__post_init__

            def scaled(self):
                post_init(self)
                self.learning_rate *= factor

            module.DiLoCoConfig.__post_init__ = scaled
        if module.__name__ == "hf_diloco.outer" and os.environ.get("CONTRIBUTION_HOOK_SCALE"):
            scale = float(os.environ["CONTRIBUTION_HOOK_SCALE"])
            original = module.OuterState.pseudo_gradient
            module.OuterState.pseudo_gradient = lambda self, *a, **k: original(self, *a, **k).mul_(scale)
        if module.__name__ == "hf_diloco.gate" and os.environ.get("CONTRIBUTION_HOOK_LEAVE_OUT"):
            left_out = int(os.environ["CONTRIBUTION_HOOK_LEAVE_OUT"])
            judge = module.judge
            module.judge = lambda rows, *a, **k: {**judge(rows, *a, **k), left_out: "left out by the test"} \
                if left_out in rows else judge(rows, *a, **k)

    class _Finder(importlib.abc.MetaPathFinder):
        """Hooks hf_diloco.config, hf_diloco.outer and hf_diloco.gate right after they are first imported."""

        def find_spec(self, name, path, target=None):
            if name not in ("hf_diloco.outer", "hf_diloco.gate", "hf_diloco.config"):
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
