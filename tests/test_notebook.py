"""``examples/quickstart.ipynb`` runs top to bottom, so it cannot rot.

The notebook is executed once per session with ``nbclient`` (every cell, in order, a timeout per
cell) on an ipykernel started with *this* interpreter (``sys.executable``), whatever kernelspecs
happen to be installed: no ``ipykernel install`` step. The working directory is ``examples/``,
as when a user opens the notebook there. The tests then read what the cells printed and showed.

The notebook is stored without outputs (small diffs; outputs would go stale since nothing here
compares them): ``test_stored_without_outputs`` keeps it that way. To refresh it after editing,
clear outputs before committing (Jupyter: "Clear All Outputs", or ``jupyter nbconvert
--clear-output --inplace examples/quickstart.ipynb``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpec
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

# starts a kernel and runs the notebook, once, on one pytest-xdist worker for these tests
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("notebook")]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOK = EXAMPLES / "quickstart.ipynb"
CELL_TIMEOUT_S = 300  # generous: the whole notebook takes ~30 s on a busy 2-core CPU

# Cells the test adds around the notebook's own (in memory only).
PROBE = "import sys\nprint('KERNEL-PYTHON', sys.executable)"
REPORT = (
    "import json\nprint('RESULTS-JSON', json.dumps({name: {'losses': r['losses'], "
    "'val_loss': r['val_loss']} for name, r in results.items()}))"
)


class ThisInterpreterKernelManager(AsyncKernelManager):
    """An ipykernel on ``sys.executable`` (the environment running the tests), never a
    ``python3`` kernelspec that a user or system directory may point at another Python."""

    @property
    def kernel_spec(self) -> KernelSpec:
        return KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name="Python 3 (test interpreter)",
            language="python",
        )


def _outputs_text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o.get("text", ""))
        elif o.get("output_type") in ("execute_result", "display_data"):
            out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


def _tagged(nb, tag: str) -> list:
    return [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]


@pytest.fixture(scope="session")  # once per session (see test_sweep's _compiled_on_gloo)
def executed(tmp_path_factory):
    """``(executed notebook, seconds, kernel's sys.executable, results)``."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(PROBE))
    nb.cells.append(nbformat.v4.new_code_cell(REPORT))
    scratch = tmp_path_factory.mktemp("notebook")
    with pytest.MonkeyPatch.context() as mp:  # the kernel inherits this environment
        # the inline backend renders with Agg (no display needed) and keeps the figure as a PNG
        mp.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        mp.setenv("HYPOTHESIS_STORAGE_DIRECTORY", str(scratch / "hypothesis"))
        mp.setenv("IPYTHONDIR", str(scratch / "ipython"))
        mp.setenv("JUPYTER_RUNTIME_DIR", str(scratch / "runtime"))
        client = NotebookClient(
            nb,
            timeout=CELL_TIMEOUT_S,
            kernel_name="python3",
            kernel_manager_class=ThisInterpreterKernelManager,
            resources={"metadata": {"path": str(EXAMPLES)}},
        )
        start = time.perf_counter()
        client.execute()  # raises CellExecutionError (with the traceback) if a cell fails
        seconds = time.perf_counter() - start
    print(f"\nexamples/quickstart.ipynb executed in {seconds:.1f} s")
    text = _outputs_text(nb.cells[0])
    kernel_python = text.split("KERNEL-PYTHON", 1)[1].strip()
    report = _outputs_text(nb.cells[-1])
    results = json.loads(report.split("RESULTS-JSON", 1)[1])
    return nb, seconds, kernel_python, results


def test_runs_on_this_interpreter(executed):
    _, _, kernel_python, _ = executed
    assert os.path.realpath(kernel_python) == os.path.realpath(sys.executable)


def test_no_cell_errors(executed):
    nb = executed[0]
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors, errors
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")


def test_every_optimizer_lowers_the_loss(executed):
    results = executed[3]
    assert set(results) == {
        "sgd + momentum",
        "adamw",
        "adafactor",
        "lamb",
        "came",
        "muon",
        "galore_adamw",
    }
    for name, r in results.items():
        losses = r["losses"]
        first, last = losses[0], sum(losses[-10:]) / 10
        assert math.isfinite(last) and math.isfinite(r["val_loss"]), name
        # from ~ln(256) = 5.55 nats/byte to below 3.5 (all reach 2.3 to 3.0 in 80 steps)
        assert first > 5.0 and last < 3.5 and last < first - 1.5, (name, first, last)
        assert r["val_loss"] < first - 1.0, (name, r["val_loss"])
    (train_cell,) = _tagged(executed[0], "train")
    assert "validation" in _outputs_text(train_cell)


def test_plot_is_shown(executed):
    (plot_cell,) = _tagged(executed[0], "plot")
    images = [o for o in plot_cell.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1, [o.output_type for o in plot_cell.outputs]


def test_property_tests_pass_and_catch_the_local_shard_bug(executed):
    text = "".join(_outputs_text(c) for c in _tagged(executed[0], "property-test"))
    assert "scale_by_rms: sharded == unsharded on a 2 x 2 mesh" in text
    assert "in one process the buggy transform gives the right numbers" in text
    assert "caught: sharded != unsharded: step 0, updates[" in text
    assert "scale_by_rms: 10 drawn cases pass" in text
    assert "scale_by_local_rms fails: sharded != unsharded" in text
    # hypothesis' note with the shrunk failing case (its wording varies between versions)
    assert "test_scale_by_local_rms(" in text and "mesh_shape=" in text


def test_stored_without_outputs():
    """The committed notebook has no outputs (small diffs; see the module docstring)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.outputs or c.execution_count is not None)
    ]
    assert not dirty, f"cells {dirty} have outputs: clear them before committing"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
