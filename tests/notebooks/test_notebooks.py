"""notebooks/*.ipynb run top to bottom, headless (nbclient), on a tiny configuration injected after each
notebook's "parameters" cell (papermill's convention); a cell that errors or a plot cell without an image
fails the test."""
import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from test_plot import write_run  # noqa: E402  (tests/ is on sys.path: conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ROOT / "tests" / "data" / "hellaswag_val_120.jsonl"


def run_notebook(name, params: str, cwd: Path):
    """Execute notebooks/<name> in cwd with `params` run right after its parameters cell; returns it."""
    path = ROOT / "notebooks" / name
    # nbformat 4.5: every cell has an id in the file (nbformat.read would make up missing ones)
    assert all(c.get("id") for c in json.loads(path.read_text())["cells"]), f"{name}: cells without ids"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    i = [k for k, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(i) == 1, f"{name}: one cell tagged 'parameters' expected"
    nb.cells.insert(i[0] + 1, nbformat.v4.new_code_cell(params, metadata={"tags": ["injected-parameters"]}))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    plots = [c for c in nb.cells if "plot" in c.metadata.get("tags", [])]
    assert plots, f"{name}: no cell tagged 'plot'"
    for c in plots:
        assert any("image/png" in o.get("data", {}) for o in c.outputs), f"{name}: cell {c.id} showed no plot"
    return nb


def text(cell) -> str:
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs)


def test_quickstart(tmp_path):
    nb = run_notebook("quickstart.ipynb", f'PRESET = "tiny"\nSTEPS = 4\nVAL_EVERY = 2\nBATCH_SIZE = 2\nSEQ_LEN = 16\n'
                      f'SAMPLE_TOKENS = 4\nHELLASWAG_PATH = r"{SUBSET}"\nHELLASWAG_LIMIT = 8', tmp_path)
    assert (tmp_path / "runs" / "quickstart" / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    cells = {c.id: c for c in nb.cells}
    assert "HellaSwag, first 8 items: acc" in text(cells["hellaswag"])
    assert text(cells["sample"]).startswith("ROMEO:")


def test_reproduce_124m_on_a_metrics_file(tmp_path):
    write_run(tmp_path / "gpt2_124m")
    write_run(tmp_path / "lr_sweep", params=124_475_904)
    nb = run_notebook("reproduce_124m.ipynb", f'RUN = r"{tmp_path / "gpt2_124m" / "metrics.jsonl"}"\n'
                      f'COMPARE = [r"{tmp_path / "lr_sweep"}"]', tmp_path)
    out = text({c.id: c for c in nb.cells}["summary"])
    assert "gpt2_124m | step 60 (31.5M tokens)" in out and "lr_sweep | step 60" in out, out
    assert "val_loss: best" in out and "124M run: reference lines drawn" in out, out
    assert (tmp_path / "reproduce_124m.png").read_bytes()[:4] == b"\x89PNG"
