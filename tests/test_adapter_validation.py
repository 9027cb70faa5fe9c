"""Malformed adapter folders and hostile request fields (issue 33, items 1, 2, 4 and 7): each is a 400
in OpenAI's error shape at runtime and a skipped folder (one warning) at --adapter-dir, the server
stays up and a good adapter beside them keeps its reference tokens; rank_pattern / alpha_pattern keys
match as PEFT matches them, in bounded time."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
from peft.utils.other import get_pattern_key

from asyncserve.config import Config
from asyncserve.pager.adapters import MAX_HEADER_BYTES
from asyncserve.pager.patterns import PatternError, PatternTable
from reference import assert_greedy_matches, peft_references
from server_harness import ServerThread

SOURCE = "r1_qv"            # the tiny model's adapter the malformed folders are made from
GOOD = "r16_patterns"       # served beside them (it has a rank_pattern and an alpha_pattern)
PROMPT = "the fox jumps over"
NEW_TOKENS = 6


# ---- malformed folders --------------------------------------------------------------------------

def _split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header: bytes, body: bytes) -> bytes:
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + body


def config(change):
    """A folder whose adapter_config.json is changed by ``change(cfg)``."""
    def write(folder: Path):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        change(cfg)
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return write


def raw_config(raw: bytes):
    return lambda folder: (folder / "adapter_config.json").write_bytes(raw)


def header(change):
    """A folder whose safetensors header is changed by ``change(header, tensors)`` (``tensors``: the
    entries other than __metadata__, in offset order); the data is kept."""
    def write(folder: Path):
        path = folder / "adapter_model.safetensors"
        head, body = _split(path.read_bytes())
        tensors = sorted((v for k, v in head.items() if k != "__metadata__"), key=lambda v: v["data_offsets"])
        body = change(head, tensors) or body
        path.write_bytes(_join(json.dumps(head).encode(), body))
    return write


def raw_header(raw: bytes):
    def write(folder: Path):
        path = folder / "adapter_model.safetensors"
        path.write_bytes(_join(raw, _split(path.read_bytes())[1]))
    return write


def duplicate_name(folder: Path):
    path = folder / "adapter_model.safetensors"
    head, body = _split(path.read_bytes())
    first = next(k for k in head if k != "__metadata__")
    text = json.dumps(head)            # the first tensor's name again, with the second one's entry
    second = next(k for k in head if k not in ("__metadata__", first))
    text = text.replace(json.dumps(second) + ":", json.dumps(first) + ":", 1)
    path.write_bytes(_join(text.encode(), body))


def huge_header(folder: Path):
    """A header length past MAX_HEADER_BYTES in a (sparse) file long enough to hold it."""
    path = folder / "adapter_model.safetensors"
    n = MAX_HEADER_BYTES + 8
    path.write_bytes(n.to_bytes(8, "little") + b"{")
    os.truncate(path, 8 + n + 64)


def padded(folder: Path):
    """A valid adapter padded (sparse) to 3 GiB: refused by its length, never read."""
    os.truncate(folder / "adapter_model.safetensors", 3 << 30)


def gap(head, tensors):
    tensors[-1]["data_offsets"] = [o + 8 for o in tensors[-1]["data_offsets"]]
    return None


def _gap_body(folder: Path):
    header(gap)(folder)
    with open(folder / "adapter_model.safetensors", "ab") as f:
        f.write(b"\0" * 8)


def overlap(head, tensors):
    a = next(t for t in tensors[1:] if t["shape"] == tensors[0]["shape"])      # the same size as the first
    a["data_offsets"] = list(tensors[0]["data_offsets"])


def _first(change):
    return lambda head, tensors: change(tensors[0])


BAD = {   # folder -> (how it is made, what the refusal says)
    # adapter_config.json of unexpected types and sizes
    "peft_type_int": (config(lambda c: c.update(peft_type=5)), "$.peft_type"),
    "peft_type_list": (config(lambda c: c.update(peft_type=["LORA"])), "$.peft_type"),
    "alpha_400_digits": (config(lambda c: c.update(lora_alpha=int("9" * 400))), "$.lora_alpha"),
    "alpha_bool": (config(lambda c: c.update(lora_alpha=True)), "$.lora_alpha"),
    "rank_huge": (config(lambda c: c.update(r=10**9)), "$.r"),
    "use_dora_string": (config(lambda c: c.update(use_dora="yes")), "$.use_dora"),
    "rank_pattern_list": (config(lambda c: c.update(rank_pattern=["q_proj"])), "$.rank_pattern"),
    "rank_pattern_string_value": (config(lambda c: c.update(rank_pattern={"q_proj": "1"})), "$.rank_pattern"),
    "rank_pattern_huge_value": (config(lambda c: c.update(rank_pattern={"q_proj": 10**30})), "$.rank_pattern"),
    "alpha_pattern_string_value": (config(lambda c: c.update(alpha_pattern={"q_proj": "big"})), "$.alpha_pattern"),
    "rank_pattern_bad_regex": (config(lambda c: c.update(rank_pattern={"(": 1})), "rank_pattern key '('"),
    "rank_pattern_unbalanced": (config(lambda c: c.update(rank_pattern={"q_proj)|(.*": 1})), "unbalanced"),
    "rank_pattern_lookahead": (config(lambda c: c.update(rank_pattern={"(?=q)q_proj": 1})), "lookaround"),
    "alpha_pattern_backreference": (config(lambda c: c.update(alpha_pattern={r"(q)\1_proj": 1})), r"\1"),
    "rank_pattern_long_key": (config(lambda c: c.update(rank_pattern={"x" * 300 + "q_proj": 1})), "characters"),
    "rank_pattern_many_keys": (config(lambda c: c.update(rank_pattern={f"k{i}": 1 for i in range(2000)})), "keys"),
    "config_not_utf8": (raw_config(b'{"peft_type": "LORA", "r": 1, "note": "\xff\xfe"}'), "not UTF-8"),
    "config_nested_deep": (raw_config(b'{"r": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "not JSON"),
    "config_a_list": (raw_config(b'[{"r": 1}]'), "Expected `object`"),
    "config_not_json": (raw_config(b'{"r": 1,'), "not JSON"),
    # safetensors headers
    "dtype_list": (header(_first(lambda t: t.update(dtype=["F32"]))), "malformed entry"),
    "shape_string": (header(_first(lambda t: t.update(shape="4"))), "malformed entry"),
    "shape_negative": (header(_first(lambda t: t.update(shape=[-1, 64]))), "malformed entry"),
    "offsets_one": (header(_first(lambda t: t.update(data_offsets=[0]))), "malformed entry"),
    "offsets_strings": (header(_first(lambda t: t.update(data_offsets=["0", "256"]))), "malformed entry"),
    "offsets_huge": (header(_first(lambda t: t.update(data_offsets=[0, 10**30]))), "malformed entry"),
    "shape_huge": (header(_first(lambda t: t.update(shape=[10**30, 64]))), "malformed entry"),
    "header_nested_deep": (raw_header(b"[" * 100_000), "not UTF-8 JSON"),
    "header_not_utf8": (raw_header(b'{"\xff": 1}'), "not UTF-8 JSON"),
    "header_a_list": (raw_header(b"[]"), "not a JSON object"),
    "metadata_a_list": (header(lambda h, t: h.update(__metadata__=[1])), "__metadata__"),
    "header_over_limit": (huge_header, f"at most {MAX_HEADER_BYTES}"),
    "header_past_the_end": (lambda f: (f / "adapter_model.safetensors").write_bytes((10**6).to_bytes(8, "little")),
                            "runs past the end"),
    "padded_3gib": (padded, "its header says"),
    "duplicate_names": (duplicate_name, "appears twice"),
    "overlapping_offsets": (header(overlap), "a gap or an overlap"),
    "gapped_offsets": (_gap_body, "a gap or an overlap"),
}


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapter_validation")
    shutil.copytree(tiny_model.adapters[GOOD], root / "good")
    for name, (make, _) in BAD.items():
        shutil.copytree(tiny_model.adapters[SOURCE], root / name)
        make(root / name)
    # not malformed: a key that makes `re` backtrack for hours matches no module here, in microseconds
    shutil.copytree(tiny_model.adapters[SOURCE], root / "pathological_pattern")
    config(lambda c: c.update(rank_pattern={"(.|.)*X": 8, "(a*)*b": 8}))(root / "pathological_pattern")
    shutil.copytree(tiny_model.adapters[SOURCE], root / "evil\nFORGED line")      # a name no log may hold
    (root / "links").mkdir()
    (root / "links" / "evil").symlink_to(root / "evil\nFORGED line")
    return root


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def served(tiny_model, folders):
    """A server started with --adapter-dir over the malformed folders (and --adapter-root there),
    with the log records of its start."""
    records = _Records()
    logging.getLogger("asyncserve").addHandler(records)
    level = logging.getLogger("asyncserve").level
    logging.getLogger("asyncserve").setLevel(logging.INFO)
    try:
        st = ServerThread(Config(model=str(tiny_model.root), dtype="float32", device="cpu", served_model_name="tiny",
                                 adapter_dir=str(folders), adapter_root=str(folders), threads=1))
        try:
            yield st, records
        finally:
            st.stop()
    finally:
        logging.getLogger("asyncserve").removeHandler(records)
        logging.getLogger("asyncserve").setLevel(level)


def _tokens(st: ServerThread, model: str) -> tuple[list[int], list[int]]:
    status, body, _ = st.request("POST", "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                              "temperature": 0.0, "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def _assert_good_served(st: ServerThread, tiny_model, folders: Path) -> None:
    prompt_ids, tokens = _tokens(st, "good")
    ref, = peft_references(tiny_model.base, {"good": folders / "good"}, [(prompt_ids, "good")], NEW_TOKENS)
    assert_greedy_matches(tokens, ref, 1e-3, "the good adapter beside the malformed ones")
    status, body, _ = st.request("GET", "/health")
    assert status == 200 and body == {"status": "ok"}


def _assert_openai_400(status, body, fragment: str | None = None) -> None:
    assert status == 400, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    if fragment is not None:
        assert fragment in error["message"], error


def test_adapter_dir_skips_every_malformed_folder_with_one_warning(served, tiny_model, folders):
    st, records = served
    _, models, _ = st.request("GET", "/v1/models")
    assert {m["id"] for m in models["data"]} == {"tiny", "good", "pathological_pattern"}
    warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING and "skipping" in r.getMessage()]
    for name, (_, fragment) in BAD.items():
        lines = [w for w in warnings if f"/{name}: " in w]
        assert len(lines) == 1 and fragment in lines[0], (name, lines)
    forged = [w for w in warnings if "evil" in w]
    assert len(forged) == 1 and "\\nFORGED line" in forged[0] and "non-printable" in forged[0], forged
    assert not any("\n" in r.getMessage() for r in records.records), "a log record holds a newline"
    _assert_good_served(st, tiny_model, folders)
    # the pathological key matched nothing: the adapter's tokens are its source's, as PEFT gives them
    prompt_ids, tokens = _tokens(st, "pathological_pattern")
    ref, = peft_references(tiny_model.base, {SOURCE: tiny_model.adapters[SOURCE]}, [(prompt_ids, SOURCE)], NEW_TOKENS)
    assert_greedy_matches(tokens, ref, 1e-3, "the adapter with a pathological rank_pattern key")


@pytest.mark.parametrize("name", list(BAD))
def test_runtime_load_of_a_malformed_folder_is_a_400(served, name):
    st, _ = served
    t0 = time.monotonic()
    status, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": f"rt_{name}", "lora_path": name})
    _assert_openai_400(status, body, BAD[name][1])
    assert body["error"]["param"] == "lora_path"
    assert time.monotonic() - t0 < 30          # a bound on the refusal, far above it (the padded file is 3 GiB)
    status, body, _ = st.request("GET", "/health")
    assert status == 200, body


def test_the_server_serves_on_after_the_runtime_refusals(served, tiny_model, folders):
    st, _ = served
    for name in list(BAD)[:3]:
        st.request("POST", "/v1/load_lora_adapter", {"lora_name": f"again_{name}", "lora_path": name})
    _, models, _ = st.request("GET", "/v1/models")
    assert not any(m["id"].startswith(("rt_", "again_")) for m in models["data"])
    status, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": "patho2", "lora_path": "pathological_pattern"})
    assert status == 200, body
    _assert_good_served(st, tiny_model, folders)


# ---- request bodies, paths and names (item 7) ------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
BODIES = {
    "nested_bare": DEEP,
    "nested_in_a_field": b'{"model": "tiny", "prompt": "x", "stop": ' + DEEP + b"}",
    "nested_objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "not_utf8_in_a_string": b'{"model": "tiny", "prompt": "\xff\xfe", "lora_name": "\xc3(", "lora_path": "a"}',
    "not_utf8_outside_strings": b'{"model": "tiny", \xff "prompt": "x"}',
    "latin1": '{"model": "tiny", "prompt": "café", "lora_name": "é", "lora_path": "é"}'.encode("latin-1"),
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/tokenize"])
@pytest.mark.parametrize("body", list(BODIES))
def test_bodies_nested_deep_or_not_utf8_are_400(served, path, body):
    st, _ = served
    status, out, _ = st.request("POST", path, BODIES[body])
    _assert_openai_400(status, out)
    assert out["error"]["code"] in ("invalid_json", "invalid_value"), out


@pytest.mark.parametrize("lora_path, status, fragment", [
    ("good\0", 400, "printable"),
    ("\0", 400, "printable"),
    ("a" * 10_000, 400, "at most 4096"),
    ("x" * 300, 400, "File name too long"),          # one part past NAME_MAX
    ("a/" * 2_000, 404, "no adapter folder"),         # under PATH_MAX, each part short: not there
    ("good\nFORGED", 400, "printable"),
    ("links/evil", 400, "non-printable"),             # a printable link to a name that is not
    ("", 400, "non-empty"),
])
def test_bad_lora_paths_are_4xx(served, lora_path, status, fragment):
    st, _ = served
    got, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": "p", "lora_path": lora_path})
    assert got == status and set(body["error"]) == {"message", "type", "param", "code"}, (got, str(body)[:300])
    assert fragment in body["error"]["message"] and body["error"]["param"] == "lora_path", str(body)[:300]


@pytest.mark.parametrize("lora_name", ["x\nFORGED line", "x\rFORGED", "\x1b[31mred", "nul\0", "tab\tname",
                                       "line\u2028separator", "n" * 300, ""])
def test_names_with_control_characters_are_refused_and_never_logged_raw(served, lora_name, caplog):
    st, _ = served
    caplog.set_level(logging.INFO, logger="asyncserve")
    status, body, _ = st.request("POST", "/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": "good"})
    _assert_openai_400(status, body)
    assert body["error"]["param"] == "lora_name"
    status, body, _ = st.request("POST", "/v1/unload_lora_adapter", {"lora_name": lora_name})
    assert status == 404, body
    status, body, _ = st.request("POST", "/v1/completions", {"model": lora_name, "prompt": "x", "max_tokens": 1})
    assert status == 404, body
    for record in caplog.records:
        message = record.getMessage()
        assert not any(c in message for c in "\n\r\x1b\0\u2028"), message


def test_a_path_with_an_encoded_newline_is_logged_escaped(served, caplog):
    st, _ = served
    caplog.set_level(logging.INFO, logger="asyncserve")
    status, body, _ = st.request("POST", "/v1/nothing%0AFORGED%20line", b"{}")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert not any("\n" in r.getMessage() for r in caplog.records)


# ---- the pattern matcher ---------------------------------------------------------------------------

MODULES = [f"model.layers.{layer}.{'self_attn' if p < 4 else 'mlp'}.{proj}" for layer in range(32)
           for p, proj in enumerate(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])]

KEY_SETS = [
    ["q_proj"], ["v_proj", "q_proj"], ["model.layers.0.self_attn.q_proj"], ["layers.3.mlp.down_proj", "down_proj"],
    ["self_attn.q_proj", "mlp.down_proj", "up_proj"], ["attn.q_proj"], ["proj"], ["q.proj"], [""],
    [r"layers\.\d+\.self_attn\.(q|v)_proj"], [r".*\.mlp\..*"], [r"layers\.[0-9]\.mlp\.(gate|up)_proj", "mlp.up_proj"],
    ["^model.layers.1.self_attn.q_proj$"], [r"model\.layers\.(1|2|30)\..*"], [r"layers\.1[0-5]\..*proj"],
    [r"[^.]*_proj"], [r"(?:q|k)_proj", "v_proj"], [r"layers.{1,3}"], [r"\w+\.\w+_proj"], [r"\d+\.mlp\.up_proj"],
    [r"layers\.(?P<n>\d)\.mlp\.down_proj"], ["up_proj|down_proj"], [r"model.layers.(\d|1\d).self_attn.[qk]_proj"],
    [f"model.layers.{i}.self_attn.q_proj" for i in range(32)] + ["q_proj", "k_proj"],     # one key a module (EVA)
    [r"layers\.2[0-9]*\.mlp\.down_proj", r"layers\.\d{2}\..*"], [r"(self_attn|mlp)\.(q|down)_proj"],
]


@pytest.mark.parametrize("keys", KEY_SETS, ids=lambda keys: "|".join(keys)[:40])
def test_pattern_lookup_is_peft_s(keys):
    """PEFT's get_pattern_key then dict.get, as its LoRA model resolves rank and alpha, is the reference."""
    patterns = {key: i for i, key in enumerate(keys)}
    table = PatternTable(patterns, "rank_pattern")
    for module in MODULES:
        assert table.lookup(module, -1) == patterns.get(get_pattern_key(keys, module), -1), (keys, module)


@pytest.mark.parametrize("key", ["(.|.)*X", "(a*)*b", "(.*.*.*.*.*.*.*.*)*X", "(x+x+)+y", "((.)*)*$X",
                                 "(.|..|...)*" + "(.|.)*" * 10 + "Z", ".{0,64}.{0,64}.{0,64}X"])
def test_a_pathological_key_takes_under_100ms_of_cpu(key):
    t0 = time.process_time()
    try:
        table = PatternTable({key: 8}, "rank_pattern")
        values = [table.lookup(module, None) for module in MODULES]
        assert values == [None] * len(MODULES)
    except PatternError as e:          # or refused as too large or costly; either way, at once
        assert "rank_pattern key" in str(e)
    assert time.process_time() - t0 < 0.1


@pytest.mark.parametrize("key, why", [
    ("(", "missing ')'"), (")", "unbalanced"), ("a)|(b", "unbalanced"), ("(?=q)", "lookaround"),
    ("(?<!q)k", "lookaround"), ("(?i)Q_PROJ", "flags"), (r"(q)\1", r"\1"), (r"\bq_proj", r"\b"), ("a**", "repeated"),
    ("q_proj*+", "possessive"), ("*q", "nothing to repeat"), ("x{99999}", "above 64"), ("[z-a]", "reversed"),
    ("a{3,1}", "n < m"), ("[abc", "missing ']'"), ("q\\", "trailing backslash"), ("q{", "not a {m,n}"),
    ("(" * 40 + ")" * 40, "nested"), ("(((x{64}){64}){64})", "too large"),
])
def test_keys_the_matcher_cannot_take_are_refused_with_the_reason(key, why):
    with pytest.raises(PatternError, match="rank_pattern key") as e:
        PatternTable({key: 8}, "rank_pattern")
    assert why in str(e.value)


def test_pattern_table_limits():
    with pytest.raises(PatternError, match="2000 keys"):
        PatternTable({f"layers.{i}.q_proj": 8 for i in range(2000)}, "rank_pattern")
    with pytest.raises(PatternError, match="300 characters"):
        PatternTable({"q" * 300: 8}, "alpha_pattern")
