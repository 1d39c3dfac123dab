"""Running the study: data, then every (arm, seed) through the real training and evaluation entry points, then the
prefill phase and the report. ``scripts/study.py`` is its command line.

Per run, in ``OUT/runs/<arm>/seed<k>/``, each step a subprocess with ``OMP_NUM_THREADS=1`` (``jobs`` runs at once
share the cores) and its output appended to a log beside it:

1. ``train.yaml`` (``eval.study.arms.train_yaml``), then ``python scripts/train_vlm.py --config train.yaml --out
   train --deepspeed <json> --resume auto`` (one process, a free ``MASTER_PORT`` of its own; ``--overwrite``
   instead when an interrupted attempt left metrics but no checkpoint, which ``--resume auto`` refuses) ->
   ``train.log``, ``train_done.json``; a staged study runs each of its ``stages`` first the same way
   (``STAGE.yaml`` -> ``STAGE/``, ``STAGE.log``, ``STAGE_done.json``), each from the export of the one before;
2. ``python -m lmms_eval --model conceptmoe --model_args pretrained=train/hf ... --output_path eval`` (the
   Makefile's ``demo`` form) -> ``eval.log``; then ``eval.r_report.write_report`` and ``eval.score_table.write_table``
   on ``eval/`` (``r_report.json``, ``score_table.json``); an evaluation without its score table is redone whole;
3. ``result.json``: the run is finished and is never redone (delete the folder to redo it).

Order: seed 0 of every arm (config order), then seed 1, ...; with a budget no run starts once it is spent (a started
run finishes). Then ``python -m eval.study.prefill`` on the seed-0 export of every arm (redone only when an export
changed), and ``eval.study.report.write`` builds ``study.json``, the doc and the plots from the files.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import yaml
from tqdm import tqdm

from eval.study.arms import Arm
from eval.study.collect import read_json, run_dir
from eval.study.config import data_sets

REPO = Path(__file__).resolve().parents[2]
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_REPORT_LOCK = threading.Lock()  # the R report draws with matplotlib: one at a time
_PORT_LOCK = threading.Lock()
_PORTS_IN_USE: set[int] = set()


class Log:
    """Timestamped lines to stdout (through tqdm: a progress bar on the terminal stays whole) and ``OUT/study.log``."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.lock = path, threading.Lock()

    def __call__(self, line: str) -> None:
        text = f"{time.strftime('%H:%M:%S')} {line}"
        with self.lock:
            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text + "\n")


def python() -> str:
    """This interpreter, relative to the current directory when it is inside it (e.g. ``.venv/bin/python``)."""
    try:
        return str(Path(sys.executable).relative_to(Path.cwd()))
    except ValueError:
        return sys.executable


def script(name: str) -> str:
    """A script of the repository, relative to the current directory when it is inside it."""
    path = REPO / "scripts" / name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def env(port: int | None = None) -> dict:
    out = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV} | OFFLINE_ENV
    if port is not None:
        out["MASTER_PORT"] = str(port)
    return out


def run_logged(cmd: list[str], log_path: Path, port: int | None = None) -> tuple[int, float]:
    """Run ``cmd``, its output appended to ``log_path``; (return code, wall seconds)."""
    start = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(port)).returncode
    return rc, time.perf_counter() - start


def last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("error:") or "Error" in ln]
    return (errors or lines or [""])[-1][:300]


def take_port() -> int:
    """A TCP port nobody listens on now and no other run of this study holds."""
    with _PORT_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            if port not in _PORTS_IN_USE:
                _PORTS_IN_USE.add(port)
                return port


def release_port(port: int) -> None:
    with _PORT_LOCK:
        _PORTS_IN_USE.discard(port)


# ----------------------------------------------------------------------------- data
def ensure_data(study: dict, log: Log, quiet: bool = False) -> None:
    """Build the training shards (every set of ``data``), anything a ``{creates, command}`` entry makes, and the
    eval task data with ``eval.build``'s arguments when they are missing (``quiet``: without make_shards' progress
    bar); run every ``{command}`` entry and ``eval.command``. ``{python}`` in a command is this interpreter."""
    for entry in data_sets(study):
        if "command" in entry:
            if "creates" in entry and Path(entry["creates"]).exists():
                continue
            cmd = [python() if a == "{python}" else str(a) for a in entry["command"]]
            what = entry.get("creates") or shlex.join(cmd)
        else:
            shards = Path(entry["dir"])
            if all((shards / split / "manifest.json").is_file() for split in ("train", "eval")):
                continue
            cmd = [python(), script("make_shards.py"), *map(str, entry["build"]), "--out", str(shards)]
            cmd += ["--quiet"] if quiet else []
            what = f"the shards in {shards}"
        log(f"building {what}: {shlex.join(cmd)}")
        if subprocess.run(cmd, env=env()).returncode != 0:
            raise SystemExit(f"study: error: building {what} failed")
    ev = study["eval"]
    tasks_dir = Path(ev["tasks_dir"])
    if "command" in ev:  # e.g. `make demo-eval-data`: it keeps what is up to date itself (make_eval_data.py --keep)
        cmd = [python() if a == "{python}" else str(a) for a in ev["command"]]
    elif not all((tasks_dir / t / "data" / "test.jsonl").is_file() for t in ev["tasks"]):
        cmd = [python(), script("make_eval_data.py"), "--out", str(tasks_dir), *map(str, ev["build"])]
    else:
        return
    log(f"building eval data: {shlex.join(cmd)}")
    if subprocess.run(cmd, env=env()).returncode != 0:
        raise SystemExit(f"study: error: building the eval data into {tasks_dir} failed")


# ----------------------------------------------------------------------------- one run
def train_command(study: dict, path: Path, stage: str = "train") -> list[str]:
    """The training command of one stage of a run folder (``STAGE.yaml`` into ``STAGE/``): ``--resume auto``, or
    ``--overwrite`` after an attempt that left metrics but no checkpoint folder (``--resume auto`` refuses such a
    folder; ``vlm/training/resume.py``)."""
    train = path / stage
    has_ckpt = any((train / "checkpoints").glob("step_*")) if (train / "checkpoints").is_dir() else False
    metrics = train / "metrics.jsonl"
    started = metrics.is_file() and metrics.stat().st_size > 0
    mode = ["--overwrite"] if started and not has_ckpt else ["--resume", "auto"]
    cmd = [python(), script("train_vlm.py"), "--config", str(path / f"{stage}.yaml"), "--out", str(train)]
    if study.get("deepspeed"):
        cmd += ["--deepspeed", str(study["deepspeed"])]
    return cmd + mode


def eval_command(study: dict, path: Path) -> list[str]:
    ev = study["eval"]
    return [
        python(),
        "-m",
        "lmms_eval",
        "--model",
        "conceptmoe",
        "--model_args",
        f"pretrained={path / 'train' / 'hf'}",
        "--tasks",
        ",".join(ev["tasks"]),
        "--include_path",
        str(ev["tasks_dir"]),
        "--batch_size",
        str(ev.get("batch_size", 8)),
        "--limit",
        str(study["eval_limit"]),
        "--output_path",
        str(path / "eval"),
        "--log_samples",
        "--verbosity",
        "DEBUG",
    ]


def _train_stage(study: dict, arm: Arm, seed: int, path: Path, stage: str, log: Log) -> dict | None:
    """One training stage of (arm, seed) into ``path/STAGE`` (its ``STAGE.yaml``, ``STAGE.log``,
    ``STAGE_done.json``); a finished stage is never redone."""
    from eval.study.arms import train_yaml

    done = read_json(path / f"{stage}_done.json")
    if done and (path / stage / "hf" / "config.json").is_file():
        return done
    text = yaml.safe_dump(train_yaml(study, arm, seed, stage, str(path)), sort_keys=False)
    config, name = path / f"{stage}.yaml", f"{arm.name}/seed{seed}" + ("" if stage == "train" else f" {stage}")
    if config.is_file() and config.read_text(encoding="utf-8") != text and (path / stage).exists():
        log(f"{name}: error: {config} differs from the study config now; delete {path} to redo it")
        return None
    path.mkdir(parents=True, exist_ok=True)
    config.write_text(text, encoding="utf-8")
    cmd, port = train_command(study, path, stage), take_port()
    log(f"{name}: training ({shlex.join(cmd)})")
    try:
        rc, wall = run_logged(cmd, path / f"{stage}.log", port)
    finally:
        release_port(port)
    if rc != 0:
        log(f"{name}: training failed (exit {rc}): {last_line(path / f'{stage}.log')}")
        return None
    done = {"wall_s": wall, "command": cmd, "port": port}
    (path / f"{stage}_done.json").write_text(json.dumps(done, indent=1) + "\n", encoding="utf-8")
    log(f"{name}: trained in {wall:.0f} s")
    return done


def _train(study: dict, arm: Arm, seed: int, path: Path, log: Log) -> dict | None:
    """Every training stage of (arm, seed) in order (``eval.study.arms.stage_names``); the last one's record,
    with ``wall_s`` summed over the stages and each stage's record under ``stages`` when there are several."""
    from eval.study.arms import stage_names

    records = {}
    for stage in stage_names(study):
        records[stage] = _train_stage(study, arm, seed, path, stage, log)
        if records[stage] is None:
            return None
    if len(records) == 1:
        return records["train"]
    return {**records["train"], "wall_s": sum(r["wall_s"] for r in records.values()), "stages": records}


def _evaluate(study: dict, arm: Arm, seed: int, path: Path, log: Log) -> dict | None:
    from eval.r_report import write_report
    from eval.r_report_io import ReportInputError
    from eval.score_table import write_table

    out = path / "eval"
    done = read_json(path / "eval_done.json")
    if done and (out / "score_table.json").is_file():
        return done
    shutil.rmtree(out, ignore_errors=True)
    cmd = eval_command(study, path)
    log(f"{arm.name}/seed{seed}: evaluating ({shlex.join(cmd)})")
    rc, wall = run_logged(cmd, path / "eval.log")
    if rc != 0:
        log(f"{arm.name}/seed{seed}: evaluation failed (exit {rc}): {last_line(path / 'eval.log')}")
        return None
    try:
        with _REPORT_LOCK:
            write_report(out)
            write_table(out, study["eval"]["tasks_dir"])
    except (ReportInputError, OSError) as err:
        log(f"{arm.name}/seed{seed}: R report / score table failed: {str(err).splitlines()[0]}")
        return None
    done = {"wall_s": wall, "command": cmd}
    (path / "eval_done.json").write_text(json.dumps(done, indent=1) + "\n", encoding="utf-8")
    return done


def run_one(study: dict, arm: Arm, seed: int, deadline: float | None, stop: threading.Event, log: Log) -> str:
    """One (arm, seed) to its ``result.json``: "done" (already), "finished", "failed", "budget" or "stopped"."""
    path = run_dir(study["out"], arm.name, seed)
    if (path / "result.json").is_file():
        return "done"
    if stop.is_set():
        return "stopped"
    if deadline is not None and time.monotonic() > deadline:
        log(f"{arm.name}/seed{seed}: not started, the budget is spent")
        return "budget"
    train = _train(study, arm, seed, path, log)
    evaluation = _evaluate(study, arm, seed, path, log) if train and not stop.is_set() else None
    if not evaluation:
        return "stopped" if stop.is_set() else "failed"
    result = {
        "arm": arm.name,
        "seed": seed,
        "train": train,
        "eval": evaluation,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (path / "result.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log(f"{arm.name}/seed{seed}: finished")
    return "finished"


def run_all(
    study: dict, arms: list[Arm], seeds: int, jobs: int, budget_min: float | None, log: Log, show_progress: bool = False
) -> dict:
    """Every (arm, seed), seed-major, ``jobs`` at a time; returns "arm/seedK" -> outcome. ``show_progress``: a tqdm
    bar of the runs done (whatever their outcome) on stderr when it is a terminal."""
    deadline = None if budget_min is None else time.monotonic() + 60.0 * budget_min
    order = [(arm, seed) for seed in range(seeds) for arm in arms]
    for arm, seed in order:
        if (run_dir(study["out"], arm.name, seed) / "result.json").is_file():
            log(f"{arm.name}/seed{seed}: finished before (result.json): skipped")
    stop = threading.Event()  # set on Ctrl-C: queued runs never start (the running ones got the signal too)
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    bar = tqdm(total=len(order), desc="study", unit=" runs", disable=None if show_progress else True)
    try:
        futures = {f"{a.name}/seed{s}": pool.submit(run_one, study, a, s, deadline, stop, log) for a, s in order}
        for _ in as_completed(futures.values()):
            bar.update()
        return {key: future.result() for key, future in futures.items()}
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()


# ----------------------------------------------------------------------------- prefill
def run_prefill(study: dict, arms: list[Arm], log: Log) -> None:
    """The prefill phase on the seed-0 exports (lowest finished seed), redone only when an export changed."""
    exports = {}
    for arm in arms:
        for seed in range(study["seeds"]):
            path = run_dir(study["out"], arm.name, seed)
            if (path / "result.json").is_file():
                exports[arm.name] = str(path / "train" / "hf")
                break
    base = arms[0].name
    if base not in exports:
        log("prefill: skipped (no finished baseline run)")
        return
    out = Path(study["out"]) / "prefill.json"
    stamp = {n: os.path.getmtime(Path(p) / "model.safetensors") for n, p in exports.items()}
    old = read_json(out) or {}
    if old.get("exports") == exports and old.get("mtimes") == stamp:
        log("prefill: up to date")
        return
    pf = study["prefill"]
    cmd = [
        python(),
        "-m",
        "eval.study.prefill",
        "--out",
        str(out),
        "--baseline",
        f"{base}={exports[base]}",
        "--tokens",
        str(pf.get("tokens", 4096)),
        "--repeats",
        str(pf.get("repeats", 3)),
    ]
    for name, path in exports.items():
        if name != base:
            cmd += ["--arm", f"{name}={path}"]
    log(f"prefill: {shlex.join(cmd)}")
    rc, _ = run_logged(cmd, Path(study["out"]) / "prefill.log")
    if rc != 0:
        log(f"prefill: failed (exit {rc}): {last_line(Path(study['out']) / 'prefill.log')}")
        return
    result = read_json(out)
    result.update(mtimes=stamp, command=cmd)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
