"""The linter, in the quick tier: ruff (pinned in requirements-common.txt; rules in ruff.toml) for
unused imports and names and undefined names, and the import order below, over the whole tree.

Import order is checked here rather than by ruff's isort rule, which would also rewrap every long
import into one name per line: the order is the isort convention (the standard library, then
third-party packages, then this repository's modules; in each, `import x` lines before `from x
import` lines, each sorted by module), the wrapping stays the authors'."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("", "grpo", "kernels", "tests", "scripts", "bench", "examples")


def python_files() -> list[Path]:
    skip = {".venv", ".cache", "runs", "wandb", ".git"}
    return sorted(p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts))


def first_party() -> set[str]:
    """This repository's top-level module names: its packages and the modules beside its scripts and tests."""
    names = set()
    for d in SOURCE_DIRS:
        for p in (ROOT / d).iterdir():
            if p.suffix == ".py" or (p / "__init__.py").is_file():
                names.add(p.stem)
    return names


def order_errors(path: Path, local: set[str], root: Path = ROOT) -> list[str]:
    """The leading import block's statements out of isort's order, one line each."""
    tree = ast.parse(path.read_text(), str(path))
    block = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and not block:
            continue  # the docstring
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        block.append(node)

    def key(node) -> tuple:
        module = node.names[0].name if isinstance(node, ast.Import) else ("." * node.level + (node.module or ""))
        top = module.split(".")[0]
        section = 2 if node_level(node) or top in local else 0 if top in sys.stdlib_module_names else 1
        return section, isinstance(node, ast.ImportFrom), module.lower()

    keys = [key(node) for node in block]
    return [f"{path.relative_to(root)}:{block[i + 1].lineno}: import out of order (after line {block[i].lineno})"
            for i in range(len(keys) - 1) if keys[i + 1] < keys[i]]


def node_level(node) -> int:
    return getattr(node, "level", 0) or 0


def test_the_tree_passes_the_linter():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -r requirements-common.txt"
    proc = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff check:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"


def test_imports_are_in_order():
    local = first_party()
    errors = [line for path in python_files() for line in order_errors(path, local)]
    assert not errors, "\n".join(errors)


def test_the_order_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""doc"""\nimport torch\nimport os\nfrom grpo import metrics\nimport json\n')
    assert [e.split(": ", 1)[0] for e in order_errors(bad, {"grpo"}, tmp_path)] == ["bad.py:3", "bad.py:5"]
