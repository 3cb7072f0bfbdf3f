"""tokenpools: token-pool admission control for multi-tenant LLM inference."""

__version__ = "0.1.0"


def core_build() -> str:
    """ "compiled" where the decision core runs as mypyc C extensions (the normal install),
    "pure Python" where it could not be compiled or TOKENPOOLS_PURE=1 skipped it."""
    from tokenpools.control import core

    return "pure Python" if (core.__file__ or "").endswith(".py") else "compiled"
