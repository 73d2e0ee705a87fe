"""A stand-in for `torchvision`, installed by bench/peers into the Dynamo venv only (as torchvision/__init__.py).

Why: `dynamo.vllm` imports its multimodal helpers at start-up, and through them transformers' Qwen2-VL image
processor, which does `from torchvision.transforms.v2 import functional`. The only torchvision builds for
this torch crash vLLM at import (`operator torchvision::nms does not exist`), so the venv has none. This
module makes every `torchvision.*` import succeed with placeholders that raise if anything is ever called.
A text model (SmolLM2) never processes an image, so nothing measured runs through it: the placeholders are
never called (transformers, which only looks for the module, reports torchvision available; only its image
processors would use it, and a text model loads none).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+bench-peers-stub"
__path__: list[str] = []  # a package with no files: submodules come from the finder below

STUB_NOTE = "torchvision is a stub in this venv (bench/peers, Dynamo only): image processing is unavailable"


class Unavailable:
    """Any attribute of a stub module: attribute access yields more placeholders, a call raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._name}.{attr}")

    def __call__(self, *_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"{self._name}: {STUB_NOTE}")


def _module_getattr(module_name: str):
    def getattr_(attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{module_name}.{attr}")
    return getattr_


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every `torchvision.<sub>` module as an empty stub package."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__getattr__ = _module_getattr(module.__name__)  # type: ignore[method-assign]


__getattr__ = _module_getattr(__name__)
sys.meta_path.append(_StubFinder())
