"""The README's example test runs as written (so the copyable example cannot rot)."""

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def _example_source() -> str:
    text = README.read_text()
    section = text[text.index("## Testing your own transforms") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_test_passes():
    ns: dict = {"__name__": "readme_example"}
    exec(compile(_example_source(), str(README), "exec"), ns)
    tests = [v for k, v in ns.items() if k.startswith("test_") and callable(v)]
    assert len(tests) == 2
    for t in tests:
        t()
