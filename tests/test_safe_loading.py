"""Safe loading: nothing in `jaxrl_llm/` can execute code hidden in a file it reads. Weights come
only from safetensors and GGUF; records are msgpack. The source is scanned (AST, so comments and
strings do not count) for pickle-family modules, torch.load, eval/exec/compile, yaml.load
without a safe loader and numpy loads that allow pickles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.reliability import record

pytestmark = pytest.mark.reliability
PACKAGE = Path(__file__).resolve().parents[1] / "jaxrl_llm"

# Modules whose loading runs arbitrary code from the file (pickle and its relatives).
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal",
                  "shelve", "jsonpickle"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def _dotted(node: ast.AST) -> str:
    """`a.b.c` for an attribute chain (empty for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def unsafe_uses(source: str, filename: str = "<src>") -> list[str]:
    """Every unsafe loading construct in `source`, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            for name in names:
                if name.split(".")[0] in UNSAFE_MODULES:
                    found.append(f"{node.lineno}: import {name}")
            if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(
                    a.name == "load" for a in node.names):
                found.append(f"{node.lineno}: from torch import load")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            leaf = name.rsplit(".", 1)[-1]
            if name in UNSAFE_BUILTINS or name in {f"builtins.{b}" for b in UNSAFE_BUILTINS}:
                found.append(f"{node.lineno}: {name}()")
            elif name == "torch.load":
                found.append(f"{node.lineno}: torch.load()")
            elif name in {"yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load"}:
                loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
                if not (loader is not None and _dotted(loader).rsplit(".", 1)[-1]
                        in SAFE_YAML_LOADERS):
                    found.append(f"{node.lineno}: {name}() without a safe Loader")
            elif leaf in {"load", "loads"} and name.split(".")[0] in {"np", "numpy"}:
                allow = _keyword(node, "allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant)
                                              and allow.value is False):
                    found.append(f"{node.lineno}: {name}(allow_pickle=...)")
            elif name.endswith("from_pretrained") and isinstance(
                    _keyword(node, "use_safetensors"), ast.Constant) and _keyword(
                    node, "use_safetensors").value is False:
                found.append(f"{node.lineno}: {name}(use_safetensors=False)")
    return found


# Each construct the scan must catch (the scanner itself is tested, so a pass means something).
UNSAFE_SAMPLES = [
    "import pickle", "from pickle import loads", "import cloudpickle", "import marshal",
    "import shelve", "import dill", "import joblib", "from torch import load",
    "torch.load('w.pt')", "eval('1+1')", "exec('x=1')", "compile('1', 'f', 'eval')",
    "builtins.eval('1')", "yaml.load(text)", "yaml.load(text, Loader=yaml.Loader)",
    "yaml.unsafe_load(text)", "yaml.full_load(text)", "np.load('a.npy', allow_pickle=True)",
    "numpy.load(f, allow_pickle=flag)",
    "AutoModel.from_pretrained(p, use_safetensors=False)",
]
SAFE_SAMPLES = [
    "yaml.safe_load(text)", "yaml.load(text, Loader=yaml.SafeLoader)", "np.load(buf)",
    "np.load(buf, allow_pickle=False)", "json.loads(s)", "# import pickle",
    "x = 'eval(1)'", "model.eval()", "safetensors.safe_open(p, framework='numpy')",
]


@pytest.mark.parametrize("snippet", UNSAFE_SAMPLES)
def test_scanner_catches_each_unsafe_construct(snippet):
    assert unsafe_uses(snippet), snippet


@pytest.mark.parametrize("snippet", SAFE_SAMPLES)
def test_scanner_passes_safe_constructs(snippet):
    assert not unsafe_uses(snippet), snippet


def test_package_has_no_unsafe_loading():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the scan sees the package
    # The scanner must flag every sample before its silence on the package means anything.
    missed = [s for s in UNSAFE_SAMPLES if not unsafe_uses(s)]
    found = {str(f.relative_to(PACKAGE.parent)): unsafe_uses(f.read_text(encoding="utf-8"), str(f))
             for f in files}
    found = {f: uses for f, uses in found.items() if uses}
    record("safe loading", "AST scan of jaxrl_llm/ for code-executing loaders", runs=1,
           failures=int(bool(found or missed)),
           detail="pickle, cloudpickle, dill, joblib, marshal, shelve, torch.load, eval, exec, "
           "compile, yaml.load without SafeLoader, np.load(allow_pickle=True), "
           f"from_pretrained(use_safetensors=False): {len(UNSAFE_SAMPLES)} constructs, each "
           "caught in a sample; none in the package")
    assert not missed, missed
    assert not found, found


def test_weights_are_read_only_from_safetensors_and_gguf():
    """The model loaders open weights with safetensors' `safe_open` or the gguf reader, never a
    framework loader that unpickles (`torch.load`, `from_pretrained` of a .bin)."""
    readers = set()
    for f in sorted((PACKAGE / "models").rglob("*.py")) + sorted((PACKAGE / "weights").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = _dotted(node.func)
                if name.endswith(("safe_open", "GGUFReader", "load_file")):
                    readers.add(name.rsplit(".", 1)[-1])
                assert not name.endswith(".from_pretrained") or "Tokenizer" in name or \
                    "Config" in name, f"{f}: {name}() may load pickled weights"
    assert "safe_open" in readers and "GGUFReader" in readers, readers
    record("safe loading", "weight readers in jaxrl_llm/models and jaxrl_llm/weights", runs=1, failures=0,
           detail="weights opened only with safetensors safe_open and gguf GGUFReader")
