"""Reads volt's TensorBoard files with Python's tensorboard (its EventAccumulator, which shares no code with volt).

  tensorboard_check.py read DIR       DIR: what the `[.tensorboard_write]` test wrote. Every scalar equals what the
                                      loggers were given (expected.tsv: tag, step, value), as the float TensorBoard
                                      stores; the hyper-parameters and the model summary are there; CSVLogger's file
                                      is in the same version folder. The same for DIR/signal, a fit stopped by SIGTERM.
  tensorboard_check.py truncated DIR  The same event file cut inside its last record of scalars, at several points:
                                      the reader still reads every record before the cut.
Prints "tensorboard ok" when every check passes; exits 1 with what differs otherwise.
"""
import glob
import os
import shutil
import struct
import sys
import tempfile

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboard.util import tensor_util


def fail(message):
    print("MISMATCH: " + message)
    sys.exit(1)


def as_float32(value):
    return struct.unpack("<f", struct.pack("<f", value))[0]


def accumulate(folder):
    acc = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc):
    return sorted((tag, e.step, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag))


def run_folder(root):
    versions = glob.glob(os.path.join(root, "volt_logs", "version_*"))
    if len(versions) != 1:
        fail(f"expected one version folder under {root}/volt_logs, found {versions}")
    return versions[0]


def event_file(folder):
    files = glob.glob(os.path.join(folder, "events.out.tfevents.*"))
    if len(files) != 1:
        fail(f"expected one event file in {folder}, found {files}")
    return files[0]


def check_scalars(root, acc):
    """Every scalar read equals what the loggers were given (root/expected.tsv), as a float; returns those."""
    expected = []
    with open(os.path.join(root, "expected.tsv")) as f:
        for line in f:
            tag, step, value = line.rstrip("\n").split("\t")
            expected.append((tag, int(step), as_float32(float(value))))
    expected.sort()
    got = scalars(acc)
    if got != expected:
        missing = sorted(set(expected) - set(got))[:5]
        extra = sorted(set(got) - set(expected))[:5]
        fail(f"{root}: {len(got)} scalars read, {len(expected)} logged; missing {missing}, unexpected {extra}")
    return expected


def check_read(root):
    folder = run_folder(root)
    event_file(folder)
    if not os.path.exists(os.path.join(folder, "metrics.csv")):
        fail(f"CSVLogger's metrics.csv is not beside the event file in {folder}")
    acc = accumulate(folder)
    if acc.file_version != 2.0:
        fail(f"file_version {acc.file_version}, expected 2 (brain.Event:2)")

    expected = check_scalars(root, acc)
    stopped = check_scalars(os.path.join(root, "signal"), accumulate(run_folder(os.path.join(root, "signal"))))

    content = acc.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    types = {h.name: h.type for h in experiment.hparam_infos}
    want_types = {"lr": api_pb2.DATA_TYPE_FLOAT64, "optimizer": api_pb2.DATA_TYPE_STRING,
                  "nesterov": api_pb2.DATA_TYPE_BOOL, "batch_size": api_pb2.DATA_TYPE_FLOAT64}
    if types != want_types:
        fail(f"hparam types {types}, expected {want_types}")
    if [m.name.tag for m in experiment.metric_infos] != ["val_loss"]:
        fail(f"hparam metrics {experiment.metric_infos}")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    values = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    if values != {"lr": 0.05, "optimizer": "sgd", "nesterov": False, "batch_size": 8.0}:
        fail(f"hparam values {values}")
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"]).session_end_info
    if end.status != api_pb2.STATUS_SUCCESS:
        fail(f"session end status {end.status}")

    texts = acc.Tensors("model_summary/text_summary")
    text = tensor_util.make_ndarray(texts[0].tensor_proto).tolist()[0].decode()
    with open(os.path.join(root, "expected_params.txt")) as f:
        params = int(f.read())
    if f"Total params: {params}" not in text or f"| 0 | lin | Linear | {params} | train |" not in text:
        fail(f"model summary text: {text!r}")
    tags = sorted({tag for tag, _, _ in expected})
    print(f"tensorboard ok: {len(expected)} scalars of {len(tags)} tags ({', '.join(tags)}), 4 hyper-parameters, "
          f"the model summary; {len(stopped)} scalars of a fit stopped by SIGTERM")


def records(data):
    """(start, end) of each whole record: a uint64 length, its CRC, the data, the data's CRC."""
    out, offset = [], 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        end = offset + 12 + length + 4
        if end > len(data):
            break
        out.append((offset, end))
        offset = end
    if offset != len(data):
        fail(f"the file ends with {len(data) - offset} bytes that are no whole record")
    return out


def record_scalars(data, start, end):
    event = event_pb2.Event.FromString(data[start + 12:end - 4])
    return [(v.tag, event.step, v.simple_value) for v in event.summary.value if v.WhichOneof("value") == "simple_value"]


def check_truncated(root):
    path = event_file(run_folder(root))
    with open(path, "rb") as f:
        data = f.read()
    bounds = records(data)
    with_scalars = [i for i, (s, e) in enumerate(bounds) if record_scalars(data, s, e)]
    last = with_scalars[-1]
    start, end = bounds[last]
    before = sorted(x for s, e in bounds[:last] for x in record_scalars(data, s, e))
    if not before:
        fail("no scalars before the last record")
    length = end - start
    cuts = {"inside the length": start + 3, "inside the length's CRC": start + 10,
            "inside the data": start + 12 + (length - 16) // 2, "inside the data's CRC": end - 2}
    for where, cut in cuts.items():
        folder = tempfile.mkdtemp()
        try:
            with open(os.path.join(folder, os.path.basename(path)), "wb") as f:
                f.write(data[:cut])
            got = scalars(accumulate(folder))
        finally:
            shutil.rmtree(folder)
        if got != before:
            fail(f"cut {where} (byte {cut}): read {len(got)} scalars, {len(before)} were written before it")
    print(f"tensorboard ok: a file cut at {len(cuts)} points inside record {last + 1} of {len(bounds)} still reads "
          f"the {len(before)} scalars before it")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("read", "truncated"):
        sys.exit(__doc__)
    (check_read if sys.argv[1] == "read" else check_truncated)(sys.argv[2])
