"""Model identity in every key (tier/identity.py), the server glue that feeds it and follows
weight updates (srt/prefix/model_identity.py, read with stand-in server arguments: no SGLang server
here), and which requests' KV may cross to the tier (srt/prefix/tier_eligibility.py). The same with
real SGLang servers: test/e2e/test_tier_identity_e2e.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_vericache.srt.prefix import model_identity as glue
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.identity import DigestCache, ModelIdentity, file_digest
from sglang_vericache.tier.keys import chunk_keys
from tier_testlib import TINY

TOKENS = list(range(8))


def _safetensors(tensors: dict[str, bytes]) -> bytes:
    """A real safetensors file: 8-byte header length, JSON header, raw data."""
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "F32", "shape": [len(data) // 4],
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(tensors.values())


def make_model(root: Path, name: str = "final", weights: bytes = b"\x01" * 64,
               config: dict | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(_safetensors({"w": weights}))
    (path / "config.json").write_text(json.dumps(config or {"hidden_size": 4, "layers": 2}))
    (path / "tokenizer.json").write_text("{}")  # not weights: ignored
    return path


def geometry(identity: ModelIdentity) -> KVGeometry:
    return dataclasses.replace(TINY, model_id=identity.model_id())


def key(identity: ModelIdentity) -> bytes:
    return chunk_keys(geometry(identity), TOKENS)[0].digest


def test_same_directory_name_different_weights_never_share_a_key(tmp_path: Path) -> None:
    run_a = make_model(tmp_path / "ckpt" / "run-a")
    run_b = make_model(tmp_path / "ckpt" / "run-b", weights=b"\x02" * 64)
    a = ModelIdentity.for_model(run_a, dtype="float32")
    b = ModelIdentity.for_model(run_b, dtype="float32")
    assert a.name == b.name == "final"
    assert a.model_id() != b.model_id()
    assert geometry(a).namespace() != geometry(b).namespace() and key(a) != key(b)


def test_same_weights_in_two_paths_share_the_identity(tmp_path: Path) -> None:
    one = make_model(tmp_path / "x", name="llama")
    two = make_model(tmp_path / "mnt" / "copy", name="other-name")
    a = ModelIdentity.for_model(one, dtype="float32")
    b = ModelIdentity.for_model(two, dtype="float32")
    assert a.model_id() == b.model_id() and key(a) == key(b)
    (two / "config.json").write_text(json.dumps({"layers": 2, "hidden_size": 4}))  # reordered
    assert ModelIdentity.for_model(two, dtype="float32").model_id() == a.model_id()
    (two / "config.json").write_text(json.dumps({"layers": 2, "hidden_size": 8}))
    assert ModelIdentity.for_model(two, dtype="float32").model_id() != a.model_id()


@pytest.mark.parametrize("change", [
    {"dtype": "bfloat16"}, {"quantization": "fp8"}, {"tp_rank": 1}, {"weights": "private:x"},
    {"overrides": '{"json_model_override_args":{"rope_scaling":{"factor":2.0}}}'},
])
def test_every_identity_field_changes_the_keys(tmp_path: Path, change: dict) -> None:
    base = ModelIdentity.for_model(make_model(tmp_path), dtype="float32")
    other = dataclasses.replace(base, **change)
    assert other.model_id() != base.model_id() and key(other) != key(base)
    assert dataclasses.replace(base, name="renamed").model_id() == base.model_id()


def test_identity_validation_and_single_file_models(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        ModelIdentity("m", "w", None, "float32", tp_rank=-1)
    with pytest.raises(ValueError, match="JSON map"):
        ModelIdentity("m", "w", None, "float32", overrides="[]")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no weight files"):
        ModelIdentity.for_model(empty, dtype="float32")
    gguf = tmp_path / "model.Q4.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(64))
    single = ModelIdentity.for_model(gguf, dtype="float32")
    assert single.config is None and single.weights


def test_digest_cache_hit_does_not_reread_the_file(tmp_path: Path) -> None:
    """The mtime trick: rewrite a file with the same size and restore its mtime; a cached
    digest stays (the file was not read again); any new mtime makes it read again."""
    cache = DigestCache(tmp_path / "cache")
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"a" * 4096)
    first = file_digest(weights, cache)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    st = weights.stat()
    weights.write_bytes(b"b" * 4096)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(weights, cache) == first          # served from the sidecar
    assert file_digest(weights, None) != first           # really different content
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert file_digest(weights, cache) != first          # new mtime: hashed again
    for entry in (tmp_path / "cache").iterdir():
        entry.write_text("{not json")
    assert file_digest(weights, cache) == file_digest(weights, None)  # broken cache: rehash


def test_identity_of_a_big_model_comes_from_the_cache_the_second_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model(tmp_path, weights=os.urandom(1 << 20))
    cache = DigestCache(tmp_path / "cache")
    first = ModelIdentity.for_model(model, dtype="float32", cache=cache)
    reads: list[str] = []
    real_open = open

    def counting_open(file, *args, **kwargs):
        if str(file).endswith(".safetensors"):
            reads.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    assert ModelIdentity.for_model(model, dtype="float32", cache=cache) == first
    assert reads == []  # no weight file was opened


# -- the server glue (srt/prefix/model_identity.py) -----------------------------------------------

def _server_args(model: Path, **overrides: object) -> SimpleNamespace:
    args = {"model_path": str(model), "dtype": "auto", "quantization": None,
            "load_format": "auto", "revision": None, "json_model_override_args": "{}",
            "weight_version": "default", "model_impl": "auto",
            "model_loader_extra_config": "{}"}
    return SimpleNamespace(**{**args, **overrides})


def test_server_identity_reads_dtype_overrides_and_rank(tmp_path: Path) -> None:
    model = make_model(tmp_path)
    config = SimpleNamespace(dtype="torch.float32", quantization=None)
    plain = glue.server_model_identity(_server_args(model), config, tp_rank=0)
    # exactly what a test (or another tool) computes for a default server on this model
    assert plain == ModelIdentity.for_model(model, dtype="float32")
    rope = glue.server_model_identity(_server_args(
        model, json_model_override_args='{"rope_scaling": {"type": "linear", "factor": 2}}'),
        config, tp_rank=0)
    spaced = glue.server_model_identity(_server_args(
        model, json_model_override_args='{"rope_scaling":{"factor":2,"type":"linear"}}'),
        config, tp_rank=0)
    rank1 = glue.server_model_identity(_server_args(model), config, tp_rank=1)
    bf16 = glue.server_model_identity(_server_args(model),
                                      SimpleNamespace(dtype="torch.bfloat16"), tp_rank=0)
    ids = {i.model_id() for i in (plain, rope, rank1, bf16)}
    assert len(ids) == 4 and spaced.model_id() == rope.model_id()
    dummy = [glue.server_model_identity(_server_args(model, load_format="dummy"), config, 0)
             for _ in range(2)]  # random weights: shared with no one, not even each other
    assert dummy[0].model_id() != dummy[1].model_id() != plain.model_id()


def _served(model: Path) -> glue.ServedWeights:
    """What a server started from ``model`` with default arguments serves."""
    config = SimpleNamespace(dtype="torch.float32", quantization=None)
    return glue.ServedWeights(glue.server_model_identity(_server_args(model), config, 0))


def test_a_disk_update_serves_the_identity_of_the_checkpoint_loaded(tmp_path: Path) -> None:
    """Two servers start from one checkpoint; one updates to another checkpoint, the other
    reloads its own: they must not share keys (a count of updates made them equal). Both on
    the new checkpoint: they share keys, with each other and with a server started from it
    (a count of updates kept them apart)."""
    start = make_model(tmp_path / "a", name="run")
    newer = make_model(tmp_path / "b", name="run", weights=b"\x07" * 64)
    one, two = _served(start), _served(start)
    started_newer = _served(newer).identity
    keys = [one.geometry_source(2, 2, 4, "float32", 8), two.geometry_source(2, 2, 4, "float32", 8)]
    first = keys[0]()
    assert keys[0]() is first  # cached: the link asks on every poll
    one.loaded_from_disk(str(newer), "auto")
    two.loaded_from_disk(str(start), "auto")
    assert one.identity == started_newer and two.identity == _served(start).identity
    assert chunk_keys(keys[0](), TOKENS) != chunk_keys(keys[1](), TOKENS)
    assert keys[1]() == first  # the same weights as at start: the same keys
    two.loaded_from_disk(str(newer), None)
    assert two.identity == one.identity == started_newer
    assert chunk_keys(keys[0](), TOKENS) == chunk_keys(keys[1](), TOKENS)
    assert (one.generation, two.generation) == (1, 2)


def test_a_disk_update_keeps_the_other_overrides_and_drops_the_start_revision(
        tmp_path: Path) -> None:
    model = make_model(tmp_path)
    config = SimpleNamespace(dtype="torch.float32", quantization=None)
    rope = '{"rope_scaling": {"type": "linear", "factor": 2}}'
    served = glue.ServedWeights(glue.server_model_identity(
        _server_args(model, json_model_override_args=rope, revision="main"), config, 0))
    served.loaded_from_disk(str(model), "safetensors")
    want = glue.server_model_identity(
        _server_args(model, json_model_override_args=rope, load_format="safetensors"), config, 0)
    assert served.identity == want


@pytest.mark.parametrize("how", ["tensor", "failed disk load", "dummy", "no weight files"])
def test_weights_that_cannot_be_named_share_nothing(tmp_path: Path, how: str) -> None:
    """Tensor / distributed / IPC updates, a failed disk load, dummy weights, a directory
    without weight files: a fresh private identity each time, never the start identity and
    never another server's."""
    model = make_model(tmp_path / "m")
    one, two = _served(model), _served(model)
    for served in (one, two):
        if how == "tensor":
            served.changed_unnamed("update_weights_from_tensor")
        elif how == "failed disk load":
            glue._around_disk_load(lambda *a: (False, "no"), _updater(served), str(model), None)
        elif how == "dummy":
            served.loaded_from_disk(str(model), "dummy")
        else:
            served.loaded_from_disk(str(tmp_path), None)
    ids = {one.identity.model_id(), two.identity.model_id(), _served(model).identity.model_id()}
    assert len(ids) == 3 and one.identity.is_private() and one.generation == 1


def _updater(served: glue.ServedWeights, draft: bool = False) -> SimpleNamespace:
    """Stand-in for SGLang's model-runner ``WeightUpdater`` (what the hook reads of it)."""
    pool = SimpleNamespace()
    served.attach(pool)
    runner = SimpleNamespace(req_to_token_pool=pool, is_draft_worker=draft)
    return SimpleNamespace(get_model_runner=lambda: runner)


def test_weight_update_hooks_move_the_served_weights(tmp_path: Path) -> None:
    """The disk hook names the checkpoint only when the load reports success; a raising
    update still moves the generation; a draft model's runner is not the KV's."""
    model, newer = make_model(tmp_path / "a"), make_model(tmp_path / "b", weights=b"\x03" * 64)
    served = _served(model)
    result = (True, "ok")
    assert glue._around_disk_load(lambda *a: result, _updater(served), str(newer), None) \
        is result  # fmt: skip
    assert served.identity == _served(newer).identity and served.generation == 1
    glue._around_disk_load(lambda *a: (True, "ok"), _updater(served, draft=True), str(model), None)
    assert served.generation == 1

    def broken(*args: object) -> None:
        raise RuntimeError("lost a shard")

    manager = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=_updater(served)
                                                         .get_model_runner()))  # fmt: skip
    with pytest.raises(RuntimeError):
        glue._around_unnamed_change("update_weights_from_tensor")(broken, manager)
    assert served.identity.is_private() and served.generation == 2


def test_kv_spanning_a_weight_change_is_not_eligible() -> None:
    """A request stamped before a weight change is not written through after it; one matched
    while the prefix cache still holds KV of the old weights (SGLang could not flush it) is
    neither looked up nor written through; after a reset both work again."""
    from sglang_vericache.srt.prefix.tier_eligibility import TierEligibility

    from sglang_vericache.requests.record import RequestEnd
    from sglang_vericache.requests.table import RequestTable

    weights, table = {"generation": 0}, RequestTable()
    rule = TierEligibility(lambda: weights["generation"], table)
    req = SimpleNamespace(rid="r")
    assert not rule.may_write(req)  # never matched: nothing known of its KV
    assert rule.matched(req) and rule.may_write(req)
    weights["generation"] = 1  # an in-place update while it runs
    assert not rule.may_write(req)
    later = SimpleNamespace(rid="later")
    assert not rule.matched(later) and not rule.may_write(later)  # the cache is old KV
    rule.tree_reset()  # SGLang flushed the cache
    assert rule.matched(later) and rule.may_write(later)
    assert table.get("later").tier_generation == 1  # the stamp is the record's
    table.close("later", RequestEnd.RELEASED)  # it ended: its stamp went with its record
    assert not rule.may_write(later)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang")
def test_only_requests_whose_tokens_are_their_content_use_the_tier() -> None:
    """SGLang's own requests: ``input_embeds`` (placeholder ids: token 1 repeated), multimodal
    inputs, LoRA / salted requests are neither looked up nor written through."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang_vericache.srt.prefix.tier_eligibility import TierEligibility, tier_content

    def req(**kwargs: object) -> Req:
        return Req("r", "", [1] * 4, SamplingParams(max_new_tokens=4), **kwargs)

    assert tier_content(req())
    assert not tier_content(req(input_embeds=[[0.5] * 8] * 4))
    assert not tier_content(req(extra_key="lora-a")) and not tier_content(req(cache_salt="s"))
    media = req()
    media.multimodal_inputs = object()  # what SGLang sets for image / audio / video inputs
    assert not tier_content(media)
    embeds = req(input_embeds=[[0.5] * 8] * 4)
    rule = TierEligibility()
    assert not rule.matched(embeds) and not rule.may_write(embeds)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang")
def test_weight_update_hooks_name_real_sglang_methods() -> None:
    """The hook targets exist in the installed SGLang (a rename would silently unhook).
    Read from the source with ast: importing SGLang's scheduler takes ~20 s."""
    import ast

    def methods(target: str) -> dict[str, list[str]]:
        module, cls = target.rsplit(".", 1)
        top = Path(importlib.util.find_spec("sglang").origin).parent
        source = top.joinpath(*module.split(".")[1:]).with_suffix(".py").read_text()
        (node,) = [n for n in ast.walk(ast.parse(source))
                   if isinstance(n, ast.ClassDef) and n.name == cls]
        return {n.name: [a.arg for a in n.args.args]
                for n in node.body if isinstance(n, ast.FunctionDef)}

    assert set(glue.UNNAMED_WEIGHT_CHANGES) | {glue.DISK_LOAD} <= set(methods(glue.WEIGHT_UPDATER))
    # the disk hook reads the path and format as the runner's first two arguments
    disk = methods(glue.RUNNER_WEIGHT_UPDATER)[glue.DISK_LOAD]
    assert disk[:3] == ["self", "model_path", "load_format"]
