"""grpoflow.trl in a real Jupyter kernel, run headless by nbclient: two trainings in one kernel, the second
interrupted (a kernel interrupt, as the notebook's stop button sends) while it waits in a callback after
its first checkpoint; then no process of it is left, its record says `cancelled`, and the same kernel
resumes it to the end. The reward function is the notebook's own (defined in `__main__`)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from grpoflow.storage.rollouts import RolloutStore

pytestmark = pytest.mark.integration

CELLS = [
    """
import os, pathlib, time
from datasets import Dataset
from transformers import TrainerCallback
from grpoflow.trl import GRPOConfig, GRPOTrainer

MODEL, OUT, URL = os.environ["NB_MODEL"], os.environ["NB_OUT"], os.environ["NB_URL"]
HOLD = pathlib.Path(os.environ["NB_HOLD"])
dataset = Dataset.from_list([{"prompt": f"Say {w}:"} for w in ("cat", "dog", "owl", "emu")])

def letters(completions, **kwargs):
    return [float(sum(ch.isalpha() for ch in c)) for c in completions]

def args(**kw):
    return GRPOConfig(output_dir=OUT, num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
                      learning_rate=1e-3, logging_steps=1, **kw)
""",
    """
first = GRPOTrainer(model=MODEL, reward_funcs=letters, train_dataset=dataset,
                    args=args(max_steps=2, grpoflow={"inference.url": URL}))
first.train()
print("FIRST", first.run_id, [e["step"] for e in first.state.log_history])
""",
    """
class Hold(TrainerCallback):  # after step 0 (checkpointed), wait until the test has interrupted the kernel
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            (HOLD / "blocked").touch()
            while not (HOLD / "release").exists():
                time.sleep(0.05)

second = GRPOTrainer(model=MODEL, reward_funcs=letters, train_dataset=dataset, callbacks=[Hold],
                     args=args(max_steps=3, save_steps=1))  # its own embedded vLLM server
second.train()
""",
    """
# the session's server, not a second embedded start: what is resumed is the store's run
second.args.grpoflow["inference.url"] = URL
out = second.train(resume_from_checkpoint=True)
print("RESUMED", second.run_id, out.global_step, [e["step"] for e in second.state.log_history])
""",
]


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def _wait_for(path: Path, cell_done: threading.Event) -> None:
    """Until the notebook's callback made `path` (an event of the run), or its cell ended without it."""
    while not path.exists():
        if cell_done.wait(0.05):
            pytest.fail("the interrupted cell ended before its run reached the callback")


def test_two_trainings_in_one_kernel_one_interrupted_then_resumed(
    tmp_path, tiny_model_dir, vllm_server, prefect_api
):
    import nbformat
    import psutil
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from prefect.settings import PREFECT_API_URL

    out, hold = tmp_path / "out", tmp_path / "hold"
    hold.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    env = {
        **os.environ,
        "NB_MODEL": str(tiny_model_dir), "NB_OUT": str(out), "NB_URL": vllm_server.url, "NB_HOLD": str(hold),
        "PREFECT_API_URL": PREFECT_API_URL.value(),  # the session's Prefect API: the flow runs show there
    }  # fmt: skip
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(tmp_path))
    client = NotebookClient(nb, km=km, timeout=600, allow_errors=False)
    try:
        with client.setup_kernel():
            kernel = psutil.Process(km.provisioner.process.pid)
            client.execute_cell(nb.cells[0], 0)
            client.execute_cell(nb.cells[1], 1)
            first = _text(nb.cells[1]).split("FIRST ")[1].split()[0]
            assert "FIRST " + first + " [1, 2]" in _text(nb.cells[1])

            done, errors = threading.Event(), []

            def interrupted_cell() -> None:
                try:
                    client.execute_cell(nb.cells[2], 2)
                except CellExecutionError as e:
                    errors.append(e)
                finally:
                    done.set()

            worker = threading.Thread(target=interrupted_cell)
            worker.start()
            _wait_for(hold / "blocked", done)
            km.interrupt_kernel()
            worker.join()
            (hold / "release").touch()
            assert errors and "KeyboardInterrupt" in str(errors[0])

            # nothing of the interrupted run is left: its server and every process it started are gone
            _gone, alive = psutil.wait_procs(kernel.children(recursive=True), timeout=60)
            assert not alive, [p.cmdline() for p in alive]
            store = RolloutStore(out)
            (second,) = [r for r in store.runs() if r != first]
            assert store.read_run_meta(second)["status"] == "cancelled"
            assert [r["step"] for r in store.read_steps(second)] == [0]

            client.execute_cell(nb.cells[3], 3)
            assert f"RESUMED {second} 3 [1, 2, 3]" in _text(nb.cells[3])
            assert store.read_run_meta(second)["status"] == "completed"
            assert sorted(r["step"] for r in store.read_steps(second)) == [0, 1, 2]
    finally:
        nbformat.write(nb, tmp_path / "executed.ipynb")  # what a user would have seen, for a failure's reader
        if km.is_alive():
            km.shutdown_kernel(now=True)
