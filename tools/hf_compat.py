"""Is the installed ``kernels`` one that the installed ``transformers`` accepts?

transformers only turns its kernel hooks on (``@use_kernel_forward_from_hub("RMSNorm")`` on LlamaRMSNorm,
Qwen3RMSNorm, MistralRMSNorm, ...; ``PreTrainedModel.set_use_kernels``) when ``kernels`` is installed in the
version range it was released against (``KERNELS_MIN_VERSION <= kernels < KERNELS_MAX_VERSION`` in
``transformers.utils.import_utils``). Outside that range it swaps in no-op decorators without a word: the
decorated classes carry no ``kernel_layer_name``, so ``kernels.kernelize`` replaces nothing and the model runs
its own code. The same happens with ``USE_HUB_KERNELS=0`` in the environment. ``hub_kernels_problem()`` says so
in one clear sentence; ``check_versions()`` exits with it.

Used by ``example.py`` and the tests (``tests/models/test_models.py``). Never imported by the kernel package, which
must not import transformers (Hub rule).
"""

from __future__ import annotations

import importlib.metadata
import os

PINNED = "pip install -r tools/requirements.txt (kernels==0.17.2 with transformers==5.22.2)"


def hub_kernels_problem(kernels_version: str | None = None) -> str | None:
    """Why transformers' kernel hooks are off in this environment, or None when they are on.

    `kernels_version` replaces the installed version (to check a candidate pair without installing it).
    """
    from packaging.version import Version

    try:
        import transformers
        from transformers.utils import import_utils
    except ImportError:
        return "transformers is not installed: " + PINNED
    if kernels_version is None:
        kernels_version = _installed_kernels()
        if kernels_version is None:
            return "the `kernels` package is not installed: " + PINNED
    lo = getattr(import_utils, "KERNELS_MIN_VERSION", None)
    hi = getattr(import_utils, "KERNELS_MAX_VERSION", None)
    if lo is not None and hi is not None and not (Version(lo) <= Version(kernels_version) < Version(hi)):
        return (
            f"transformers {transformers.__version__} does not accept kernels {kernels_version} (it wants "
            f"{lo} <= kernels < {hi}) and silently turns its kernel hooks off: its decorated layers (LlamaRMSNorm, "
            f"Qwen3RMSNorm, ...) would never be replaced. Install a matching pair: {PINNED}."
        )
    from transformers.utils import ENV_VARS_TRUE_VALUES

    if os.environ.get("USE_HUB_KERNELS", "YES").upper() not in ENV_VARS_TRUE_VALUES:
        return (
            f"USE_HUB_KERNELS={os.environ['USE_HUB_KERNELS']} turns transformers' kernel hooks off: its decorated "
            "layers (LlamaRMSNorm, Qwen3RMSNorm, ...) would never be replaced. Unset it."
        )
    if not import_utils.is_kernels_available() and kernels_version == _installed_kernels():
        return f"transformers {transformers.__version__} cannot use the installed kernels {kernels_version}: {PINNED}."
    return None


def _installed_kernels() -> str | None:
    try:
        return importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions() -> None:
    """Exit with a clear message when transformers would silently ignore the kernels (see the module doc)."""
    problem = hub_kernels_problem()
    if problem is not None:
        raise SystemExit(problem)
