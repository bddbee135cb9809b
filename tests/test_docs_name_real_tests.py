"""Every test the README and docs/ name (`test_file.py::test_name`, as docs/faults.md's table does for
each fault) exists. A merge once left docs/faults.md naming a test under a file it had moved out of."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = re.compile(r"(test_[a-z0-9_]+\.py)::(test_[A-Za-z0-9_]+)")


def named_tests() -> list[tuple[str, str, str]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return sorted({(str(page.relative_to(ROOT)), file, name)
                   for page in pages for file, name in REFERENCE.findall(page.read_text())})


def test_the_docs_name_tests_that_exist():
    named = named_tests()
    assert len(named) > 20  # docs/faults.md alone names dozens: the pattern still finds them
    missing = [f"{page}: {file}::{name}" for page, file, name in named
               if not (ROOT / "tests" / file).is_file()
               or not re.search(rf"^def {name}\(", (ROOT / "tests" / file).read_text(), re.MULTILINE)]
    assert not missing, "\n".join(missing)
