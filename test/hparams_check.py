"""Reads the hyper-parameters a volt fit kept, with Python's own readers (they share no code with volt).

  hparams_check.py checkpoints DIR   every checkpoint in DIR/checkpoints, read with torch.load(weights_only=True),
                                     holds `hyper_parameters` equal to the configuration that ran (DIR/printed_config.json,
                                     what --print_config printed) with the module's own (DIR/module_hparams.json) at its
                                     top level.
  hparams_check.py logs DIR          the loggers' DIR/volt_logs/version_0/hparams.yaml parses (PyYAML's safe_load) to
                                     the same, and TensorBoard's HPARAMS session holds the same values flattened
                                     (`trainer/max_epochs`; None as "None", a list as its JSON text).
DIR is what the `[.hparams_export]` test wrote. Prints "hparams ok" when every check passes; exits 1 with "MISMATCH"
and what differs otherwise.
"""
import glob
import json
import os
import sys


def fail(message):
    print("MISMATCH: " + message)
    sys.exit(1)


def expected(folder):
    with open(os.path.join(folder, "printed_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "module_hparams.json")) as f:
        config.update(json.load(f))
    return config


def load_weights_only(path):
    """torch.load as it reads volt's files (tensors and plain containers): plainly on PyTorch 2.6 and later, whose
    default is weights_only=True. PyTorch 1.13's weights-only unpickler reads no float at all (no BINFLOAT), and
    hyper-parameters hold floats: there the file is read with the full unpickler, and the output says so."""
    import torch
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 6):
        return torch.load(path), True
    return torch.load(path, weights_only=False), False


def check_checkpoints(folder):
    want = expected(folder)
    files = sorted(glob.glob(os.path.join(folder, "checkpoints", "*.ckpt")))
    names = [os.path.basename(f) for f in files]
    if "last.ckpt" not in names or "weights_only.ckpt" not in names or len(files) < 3:
        fail(f"expected a best checkpoint, last.ckpt and weights_only.ckpt in {folder}/checkpoints; found {names}")
    for path in files:
        checkpoint, weights_only = load_weights_only(path)
        got = checkpoint.get("hyper_parameters")
        if got != want:
            fail(f"{path}: hyper_parameters {got!r} != the configuration that ran {want!r}")
    print(f"hparams ok: {len(files)} checkpoints ({', '.join(names)}), weights_only={weights_only}")


def flatten(values, prefix=""):
    out = {}
    for key, value in values.items():
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flatten(value, name))
        elif value is None:
            out[name] = "None"
        elif isinstance(value, list):
            out[name] = json.dumps(value, separators=(",", ":"))
        elif isinstance(value, bool):
            out[name] = value
        elif isinstance(value, (int, float)):
            out[name] = float(value)
        else:
            out[name] = value
    return out


def check_logs(folder):
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    want = expected(folder)
    version = os.path.join(folder, "volt_logs", "version_0")
    with open(os.path.join(version, "hparams.yaml")) as f:
        got = yaml.safe_load(f)
    if got != want:
        fail(f"{version}/hparams.yaml reads as {got!r}, not {want!r}")
    acc = EventAccumulator(version, size_guidance={"tensors": 0})
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    shown = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    if shown != flatten(want):
        fail(f"TensorBoard's HPARAMS session holds {shown!r}, not {flatten(want)!r}")
    print(f"hparams ok: hparams.yaml and TensorBoard's HPARAMS ({len(shown)} values)")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("checkpoints", "logs"):
        sys.exit(__doc__)
    (check_checkpoints if sys.argv[1] == "checkpoints" else check_logs)(sys.argv[2])
