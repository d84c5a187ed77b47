"""No module under ``epgen/`` touches another module's private (``_name``) members: read from
the source with ``ast``, as ``tests/unit/test_imports.py`` reads the import graph.

What counts as touching: an attribute ``X._name`` where ``X`` is not ``self``, ``cls`` or
``super()`` (a module's private function, another object's private attribute: even an object
of a class of the same module, whose owner should give it a public member);
``from M import _name``; ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` of a literal
``"_name"`` on anything but ``self`` / ``cls``. Dunder names (``__x__``) are public protocol.
Third-party private members epgen cannot do without are listed in ``FOREIGN``, each with its
reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: private members of other projects that epgen uses on purpose: the expression (matched as
#: the whole access or its dotted tail, so ``self.torch.cuda._sleep`` is ``torch.cuda._sleep``)
#: -> why there is no public way
FOREIGN: dict[str, str] = {
    "os._exit": "the standard library's documented exit without cleanup: a PE whose peers "
                "are gone leaves at once rather than risk NVSHMEM waiting for them at exit",
    "torch.cuda._sleep": "PyTorch's only device spin of a given length (the benchmarks' gate "
                         "that holds a stream while launches queue behind it)",
    "torch._C": "the module holding _cuda_getCurrentRawStream",
    "torch._C._cuda_getCurrentRawStream": "the current stream's raw handle without building "
                                          "a torch Stream object (what Triton uses): the "
                                          "launch path's per-call cost",
}

_ATTR_FUNCS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_own(node) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own members."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def _foreign_ok(text: str) -> bool:
    return any(text == allowed or text.endswith("." + allowed) for allowed in FOREIGN)


def private_accesses(source: str) -> list[tuple[int, str]]:
    """``(line, access)`` for every touch of another module's or object's private member in
    ``source`` (module docstring), ``FOREIGN`` left out, in line order."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _is_own(node.value):
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    module = "." * node.level + (node.module or "")
                    out.append((node.lineno, f"from {module} import {alias.name}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTR_FUNCS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and not _is_own(node.args[0])):
            out.append((node.lineno, f"{ast.unparse(node.args[0])}.{node.args[1].value}"))
    return sorted((line, text) for line, text in out if not _foreign_ok(text))


def test_no_epgen_module_touches_private_members():
    found = []
    for path in sorted((REPO / "epgen").rglob("*.py")):
        for line, text in private_accesses(path.read_text(encoding="utf-8")):
            found.append(f"{path.relative_to(REPO)}:{line}: {text}")
    assert not found, ("private members of other modules or objects touched (give the owner "
                       "a public member):\n" + "\n".join(found))


def test_the_check_finds_every_kind_of_private_access():
    source = "\n".join([
        "from . import reference",                      # 1
        "from .dispatch_fused import _SharedParams",     # 2
        "x = reference._as_list(t, 'tokens')",           # 3
        "def f(world, rk):",                             # 4
        "    world._err_of(rk)",                         # 5
        "    return getattr(world, '_combiner', None)",  # 6
        "class A:",                                      # 7
        "    def g(self, other):",                       # 8
        "        self._mine = other._theirs",            # 9
        "        setattr(other, '_flag', 1)",            # 10
    ])
    assert private_accesses(source) == [
        (2, "from .dispatch_fused import _SharedParams"), (3, "reference._as_list"),
        (5, "world._err_of"), (6, "world._combiner"), (9, "other._theirs"),
        (10, "other._flag")]


def test_own_members_dunders_and_listed_foreign_members_pass():
    source = "\n".join([
        "import os, torch",
        "class A(B):",
        "    def f(self):",
        "        self._x = super()._y() + type(self).__name__",
        "        getattr(self, '_z', None)",
        "        self.torch.cuda._sleep(10)",
        "        getattr(torch._C, '_cuda_getCurrentRawStream', None)",
        "    @classmethod",
        "    def g(cls):",
        "        return cls._registry, obj.__dict__, hasattr(x, '__dlpack__')",
        "os._exit(1)",
    ])
    assert private_accesses(source) == []


def test_a_foreign_member_is_listed_by_its_whole_dotted_tail():
    """``FOREIGN`` lists exact accesses: another private member of the same module, or a
    name that merely ends like a listed one, is still reported."""
    assert private_accesses("torch.cuda._sleep2(1)\nmy_os._exit(1)\nos._exit2(1)") == [
        (1, "torch.cuda._sleep2"), (2, "my_os._exit"), (3, "os._exit2")]
