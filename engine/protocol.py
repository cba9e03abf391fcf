"""The embedded engine's side of SGLang's HTTP protocol: what each endpoint accepts, checked field by field before
anything reaches the batch, and the Request a /generate body becomes. Machinery, no paper section.

engine/server.py calls these parsers; a BadRequest (httpjson) answers 400 {"error": "<field>: ..."}. A /generate body
is refused, before the request may join a batch, for: input_ids not a non-empty list of ints in [0, vocab);
temperature not finite, negative or denormal (0 <= t < GREEDY_BELOW = 1e-6 is greedy, SGLang's rule); top_p outside
(0, 1]; top_k not -1 or >= 1; max_new_tokens < 1 or past the context; stop_token_ids not ids in [0, vocab); seed
outside [0, 2**64 - 1]; stream; any field SGLang has that this engine does not implement (GENERATE_FIELDS /
SAMPLING_FIELDS list what is served: an unknown field is refused, never ignored). The server adds two refusals that
need its state: a rid already queued or running, and return_routed_experts on an engine started without capture.
"""
import math
import os
import sys
import threading
import traceback
import uuid

from engine.httpjson import BadRequest

GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: a temperature in [0, 1e-6) samples greedily (raw-logit logprobs)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos", "seed")
GENERATE_FIELDS = ("input_ids", "sampling_params", "rid", "return_logprob", "return_routed_experts", "stream")
MEMORY_TAGS = ("weights", "kv_cache")  # SGLang's GPU memory tags
INIT_GROUP_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
UPDATE_FIELDS = ("names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version")
WEIGHT_GROUP = "weight_update_group"  # SGLang's default group_name


class Request:
    """One /generate request: its ids and sampling, then (filled by the batcher) its output tokens, logprobs, routed
    experts and finish reason; `done` is set when it has finished (or failed)."""

    def __init__(self, rid, input_ids, temperature, top_p, max_new_tokens, stop_ids, seed, top_k=-1):
        self.rid, self.input_ids = rid, input_ids
        self.temperature, self.top_p, self.top_k, self.max_new_tokens = temperature, top_p, top_k, max_new_tokens
        self.stop_ids, self.seed = stop_ids, seed
        self.want_routing = True  # return_routed_experts (the engine captures for every request when it captures)
        self.done = threading.Event()
        self.aborted, self.weight_version = False, None  # weight_version: set when the request finishes
        self.output_ids, self.logprobs, self.routing = [], [], None  # routing: (n_in + n_out - 1, L, k) int32
        self.finish, self.error = None, None  # error: this request's own failure inside the engine (-> HTTP 500)
        self.traceback = None  # the error's traceback (logged with the 500)
        self.cached_tokens = 0  # prompt tokens whose state came from the prefix cache (meta_info.cached_tokens)

    def fail(self, e):
        self.error = f"{type(e).__name__}: {e}"
        self.traceback = "".join(traceback.format_exception(e))  # a row's sampling error was never raised: one line
        self.finish = {"type": "abort", "message": f"engine error: {self.error}"}
        self.done.set()


# --- field checks -------------------------------------------------------------------------------
def _field(d, name, types, default=None, required=False, where=""):
    if name not in d or d[name] is None:
        if required:
            raise BadRequest(f"{where}{name}: required")
        return default
    v = d[name]
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise BadRequest(f"{where}{name}: expected {'/'.join(t.__name__ for t in types)}, got {type(v).__name__}")
    return v


def _known_fields(d, fields, where=""):
    """An unknown field is refused, never ignored (400 naming it and the fields served)."""
    for k in d:
        if k not in fields:
            raise BadRequest(f"{where}{str(k)[:50]}: not supported by this engine (fields: {', '.join(fields)})")


def _finite(d, name, default, where=""):
    v = _field(d, name, (int, float), default, where=where)
    try:
        f = float(v)
    except OverflowError:
        raise BadRequest(f"{where}{name}: out of range (an integer of {v.bit_length()} bits)") from None
    if not math.isfinite(f):
        raise BadRequest(f"{where}{name}: must be a finite number, got {f}")
    return f


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


# --- /generate ----------------------------------------------------------------------------------
def parse_generate(body, vocab_size, max_positions, eos_id):
    """Validate a /generate body -> Request; BadRequest names the offending field. Every check happens here,
    before the request can join a batch."""
    if body is None:
        raise BadRequest("body: empty (is Content-Length missing?); expected a JSON object")
    if not isinstance(body, dict):
        raise BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
    _known_fields(body, GENERATE_FIELDS)
    ids = _field(body, "input_ids", (list,), required=True)
    if not ids or not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
        raise BadRequest(f"input_ids: expected a non-empty list of token ids in [0, {vocab_size})")
    if _field(body, "stream", (bool,), False):
        raise BadRequest("stream: not supported by this engine")
    sp = _field(body, "sampling_params", (dict,), default={})
    w = "sampling_params."
    _known_fields(sp, SAMPLING_FIELDS, where=w)
    temperature = _finite(sp, "temperature", 1.0, where=w)
    if temperature < 0 or 0 < temperature < sys.float_info.min:
        raise BadRequest(f"{w}temperature: must be 0 or a normal float > 0, got {temperature!r}")
    if temperature < GREEDY_BELOW:
        temperature = 0.0  # greedy, as SGLang
    top_p = _finite(sp, "top_p", 1.0, where=w)
    if not 0 < top_p <= 1:
        raise BadRequest(f"{w}top_p: must be in (0, 1], got {top_p}")
    top_k = _field(sp, "top_k", (int,), -1, where=w)
    if top_k != -1 and top_k < 1:
        raise BadRequest(f"{w}top_k: must be -1 (off) or >= 1, got {top_k}")
    max_new = _field(sp, "max_new_tokens", (int,), 128, where=w)
    if max_new < 1 or len(ids) + max_new > max_positions:
        raise BadRequest(f"{w}max_new_tokens: must be >= 1 and len(input_ids) + max_new_tokens "
                         f"<= {max_positions}, got {max_new} with {len(ids)} input ids")
    stop = _field(sp, "stop_token_ids", (list,), [], where=w)
    if not all(_is_int(i) and 0 <= i < vocab_size for i in stop):
        raise BadRequest(f"{w}stop_token_ids: expected a list of token ids in [0, {vocab_size})")
    seed = _field(sp, "seed", (int,), None, where=w)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise BadRequest(f"{w}seed: must be in [0, 2**64 - 1], got {seed}")
    stop_ids = set(stop)
    if not _field(sp, "ignore_eos", (bool,), False, where=w):
        stop_ids.add(eos_id)
    rid = _field(body, "rid", (str,), None) or uuid.uuid4().hex
    for flag in ("return_logprob", "return_routed_experts"):
        _field(body, flag, (bool,), False)
    req = Request(rid, ids, temperature, top_p, max_new, stop_ids, seed, top_k)
    req.want_routing = bool(body.get("return_routed_experts", False))
    return req


# --- the other POST endpoints (a body of null or none at all is {}) ---------------------------------
def parse_object(body):
    """Any other POST body -> a dict (None, no body, is {})."""
    body = {} if body is None else body
    if not isinstance(body, dict):
        raise BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
    return body


def parse_disk_update(body):
    """/update_weights_from_disk -> (model_path, weight_version or None)."""
    path = _field(body, "model_path", (str,), required=True)
    if not os.path.isdir(path):
        raise BadRequest(f"model_path: not a directory: {path!r}")
    return path, _field(body, "weight_version", (str, int), None)


def parse_init_group(body):
    """/init_weights_update_group -> (master_address, master_port, rank_offset, world_size, group_name, backend)."""
    _known_fields(body, INIT_GROUP_FIELDS)
    return (_field(body, "master_address", (str,), required=True),
            _field(body, "master_port", (int,), required=True),
            _field(body, "rank_offset", (int,), required=True),
            _field(body, "world_size", (int,), required=True),
            _field(body, "group_name", (str,), WEIGHT_GROUP),
            _field(body, "backend", (str,), "nccl"))


def parse_bucket(body):
    """/update_weights_from_distributed -> (group_name, names, dtypes, shapes, weight_version or None): one bucket
    of the trainer's publish, its tensors announced by name, dtype and shape."""
    _known_fields(body, UPDATE_FIELDS)
    names = _field(body, "names", (list,), required=True)
    dtypes = _field(body, "dtypes", (list,), required=True)
    shapes = _field(body, "shapes", (list,), required=True)
    if not (len(names) == len(dtypes) == len(shapes)) or not all(
            isinstance(n, str) for n in names) or not all(
            d in ("float32", "bfloat16", "float16") for d in dtypes) or not all(
            isinstance(sh, list) and all(_is_int(x) and 0 <= x < 2**31 for x in sh) for sh in shapes):
        raise BadRequest("names / dtypes / shapes: expected lists of equal length of names, "
                         "float32|bfloat16|float16 and lists of non-negative ints")
    version = _field(body, "weight_version", (str,), None)
    return _field(body, "group_name", (str,), WEIGHT_GROUP), names, dtypes, shapes, version


def parse_group_name(body):
    """/destroy_weights_update_group -> group_name."""
    return _field(body, "group_name", (str,), WEIGHT_GROUP)


def parse_tags(body):
    """/release_memory_occupation, /resume_memory_occupation -> the memory tags (None: all of MEMORY_TAGS)."""
    _known_fields(body, ("tags",))
    tags = _field(body, "tags", (list,), None)
    if tags is not None and (not tags or not all(t in MEMORY_TAGS for t in tags)):
        raise BadRequest(f"tags: expected a non-empty list of {'|'.join(MEMORY_TAGS)}, got {tags!r}")
    return tags


def parse_rid(body):
    """/abort_request -> rid."""
    return _field(body, "rid", (str,), required=True)
