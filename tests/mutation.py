"""Mutants made from the product's own source: one small edit, the kind of slip a refactor makes."""

import __future__
import inspect
import sys
import textwrap


def mutate(monkeypatch, owner, name: str, original: str, mutated: str) -> None:
    """Patch ``owner.name`` with its own source, ``original`` replaced by ``mutated``.

    The source must contain ``original`` exactly once, so a refactor of the product code
    makes this fail loudly instead of silently testing an unchanged function.
    """
    function = getattr(owner, name)
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(original) == 1, f"{name} no longer contains {original!r}: update the mutant"
    module = sys.modules[function.__module__]
    code = compile(
        source.replace(original, mutated), inspect.getsourcefile(function), "exec",
        flags=__future__.annotations.compiler_flag, dont_inherit=True,  # as the module itself is compiled
    )  # fmt: skip
    namespace = {}
    exec(code, module.__dict__, namespace)
    monkeypatch.setattr(owner, name, namespace[name])
