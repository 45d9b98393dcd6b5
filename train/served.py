"""data.source=vllm: training fed live by vLLM servers; no feature dump, and no target in the training ranks.

Training reads the prep's rendered samples (<prep>/rendered/: token ids and loss masks; `make prep
ARGS="stage=render"` writes only those) and gets each sample's taps and teacher from vLLM's own servers through
prep's own client (serving/client.py VLLMClient; the `vllm.*` keys mean what they mean to prep) and prep's
own reading of the hidden-states connector's files (data_prep/vllm_capture.py stream_features, build_sample): a
sample is what a prep with capture.engine=vllm writes for it on the same server, returned as its shard set returns
it (data_prep.shards.as_read_back). From there the sampler, windows, collate and objective are offline's and
online's (train/online.py): one code path.

Lookahead: ShardBatches tells the source the order in which this rank will ask for its samples for the rest of an
epoch (`plan`), and one request stream runs over that order, so while a step trains the next samples' requests are
already in flight: at most vllm.max_in_flight requests, and at most vllm.scratch_gb of their files (a request's file
counted from when it is sent until its sample is read; the bound in bytes). A trainer whose servers keep up finds
its samples answered; the summary's `feature_wait_share` (train/trainer.py) says how much of the training loop
waited for them.

Where the servers run:
- started by training (vllm.urls empty): data.vllm_servers_per_node servers on every node, server s started by the
  node's local rank s mod (ranks on the node), each on its own group of tensor_parallel_size x
  pipeline_parallel_size devices after the training ranks' (training rank l computes on device l; server s takes
  the node's devices from local_world + s*g on), or on the CPU, under prep's guard (serving/server.py: it stops
  the server when its rank is gone, kill -9 included). Every rank learns its node's servers' addresses (one
  all_gather at start) and the node's ranks split them (serving/client.py node_urls' rule).
- the user's (vllm.urls): servers already running on the training ranks' nodes (a server writes its files on its
  own node), started with the flags docs/scaling.md gives.
Each rank has its own requests and its own scratch directory (node-local, removed when the rank is gone).

Failures: a server that exits, refuses a request, or goes silent for vllm.timeout_s with requests in flight stops
the run with VLLMServerError naming the server and its log (launch/errors.py: exit status 3); the checkpoints
written stay as they are, and a rerun with train.resume=true continues from the last one. A stop signal does not
end a wait for features: the trainer stops at its next step boundary (a checkpoint, exit status 75). When the
servers went with the signal (SLURM signals every process of the step, and vLLM exits on SIGTERM), the failed wait
is Preempted instead of an engine error, and the trainer checkpoints at its last optimizer step, every rank at the
same batch (train/trainer.py next_batch).
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from data_prep.rendered import Rendered, RenderedSet
from data_prep.shards import Sample, ShardError, ShardSpec, as_read_back
from infra.config_keys import ConfigError
from train.config import RunConfig

LOG_NAME = "vllm.{node}.s{server}.log"  # a started server's log, in the run directory


@dataclass
class StartedServer:
    """What every rank of a node needs of a server one of them started: where to send, the key, its log."""

    url: str
    key: str
    log: str
    node: str

    def where(self) -> str:
        return f"vLLM server {self.url} (log: {self.log})"


def node_id() -> str:
    """This node among the job's: torchrun's node rank (GROUP_RANK) where it is set, else the host name; two
    torchrun launches on one machine are two nodes."""
    group = os.environ.get("GROUP_RANK")
    return f"node{group}" if group is not None else socket.gethostname()


def server_devices(server: int, group: int, local_world: int, num_devices: int, visible: str | None) -> str | None:
    """The devices of a node's server `server` (CUDA_VISIBLE_DEVICES' form): the group of `group` devices after the
    node's `local_world` training ranks' and the servers' before it; None on a machine without devices (the
    server runs on the CPU). ConfigError when the node has too few."""
    if num_devices == 0:
        return None
    ids = visible.split(",") if visible else [str(i) for i in range(num_devices)]
    first = local_world + server * group
    if first + group > len(ids):
        raise ConfigError(f"data.vllm_servers_per_node={server + 1}+ x {group} devices (vllm.tensor_parallel_size x "
                          f"pipeline_parallel_size) beside {local_world} training ranks need {first + group} devices "
                          f"per node, this node has {len(ids)}: start fewer training ranks or servers per node")
    return ",".join(ids[first : first + group])


class ServedSamples:
    """A split's rendered samples, their features asked of the vLLM servers: the sample source of data.source=vllm
    (the interface of train/online.py OnlineSamples: manifest, lengths, sample_ids, get_many, captured, stats).

    max_tokens: send only each sample's first max_tokens (data.overflow=truncate keeps no more; the target is
    causal, so their features are what the whole sample's give); None: whole samples."""

    def __init__(self, rendered: RenderedSet, features: ServedFeatures, max_tokens: int | None = None):
        self.rendered, self.features, self.max_tokens = rendered, features, max_tokens
        self._planned: list[int] = []  # the distinct samples of each planned batch not kept, in order, not yet taken
        self._stream: Iterator[tuple[int, Sample]] | None = None
        self.received = 0  # samples taken (requests sent ahead past the run's end are not counted)
        self._ids: list[str] | None = None

    def __str__(self) -> str:
        return f"{self.rendered.root} ({self.rendered.spec.target.get('id')} on vLLM: {self.features.where})"

    @property
    def manifest(self) -> ShardSpec:
        return self.rendered.spec

    def __len__(self) -> int:
        return len(self.rendered)

    def lengths(self) -> list[int]:
        return self.rendered.lengths()

    def sample_ids(self) -> list[str]:
        return self.rendered.sample_ids()

    def _sent(self, i: int) -> Rendered:
        r = self.rendered[i]
        if self.max_tokens is not None and len(r.input_ids) > self.max_tokens:
            r = Rendered(r.conversation_id, r.input_ids[: self.max_tokens], r.loss_mask[: self.max_tokens])
        return r

    def plan(self, batches: list[list[int]]) -> None:
        """The samples this rank will ask for, batch by batch (the rest of an epoch): one request stream runs
        ahead over those the cache does not hold. A plan replaces the one before (its requests still in flight are
        dropped)."""
        self.close()
        cache = self.features.cache
        self._planned = [i for batch in batches for i in dict.fromkeys(batch)
                         if (self._key(i)) not in cache]
        if self._planned:
            self._stream = self.features.stream([(i, self._sent(i)) for i in self._planned])

    def _key(self, i: int) -> tuple[str, int]:
        if self._ids is None:
            self._ids = self.rendered.sample_ids()
        return self._ids[i], len(self._sent(i).input_ids)

    def captured(self, indices: list[int]) -> list[Sample]:
        """Samples `indices` as prep's vLLM capture makes them: from the cache, else from the planned stream when
        they are its next ones, else asked for now; what was asked for is kept while the cache has room."""
        distinct = list(dict.fromkeys(indices))
        self.received += len(distinct)
        cache = self.features.cache
        got = {i: cache.get(self._key(i)) for i in distinct}
        missing = [i for i, sample in got.items() if sample is None]
        if missing:
            if self._stream is not None and self._planned[: len(missing)] == missing:
                got.update(next(self._stream) for _ in missing)
                del self._planned[: len(missing)]
            else:  # not planned (a lone lookup): its own requests, the plan's left as they are
                got.update(self.features.stream([(i, self._sent(i)) for i in missing]))
            for i in missing:
                cache.put(self._key(i), got[i])
        return [got[i] for i in indices]

    def get_many(self, indices: list[int], owned: list[bool] | None = None) -> list[Sample]:
        return [as_read_back(s, self.manifest) for s in self.captured(indices)]

    def __getitem__(self, i: int) -> Sample:
        return self.get_many([i])[0]

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()  # type: ignore[attr-defined]
            self._stream, self._planned = None, []

    def stats(self) -> dict:
        cache = self.features.cache
        return {"source": "vllm", "target_dtype": self.features.dtype, "samples_received": self.received,
                "samples_requested": self.features.requested, "samples_from_cache": cache.hits,
                "samples_recomputed": cache.recomputed, "cache_bytes": cache.used, "cache_limit_bytes": cache.limit,
                "servers": self.features.where, "bytes_written": 0, "next_token_agreement": self.features.agreement()}


class FeatureCache:
    """The samples a rank's servers computed, kept in host memory up to `limit` bytes (data.vllm_cache_gb) by
    (sample id, tokens sent): the features of a sample are computed once per run, and what does not fit is asked
    for again each time it is needed (`recomputed`)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._kept: dict[tuple[str, int], Sample] = {}
        self.hits = self.recomputed = 0
        self._seen: set[tuple[str, int]] = set()

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._kept

    def get(self, key: tuple[str, int]) -> Sample | None:
        sample = self._kept.get(key)
        if sample is not None:
            self.hits += 1
        elif key in self._seen:
            self.recomputed += 1
        return sample

    def put(self, key: tuple[str, int], sample: Sample) -> None:
        self._seen.add(key)
        size = sum(t.numel() * t.element_size() for t in vars(sample).values() if isinstance(t, torch.Tensor))
        if key not in self._kept and self.used + size <= self.limit:
            self._kept[key] = sample
            self.used += size


class ServedFeatures:
    """A rank's vLLM servers turned into shard samples: `stream(items)` sends each (key, rendered sample) and yields
    (key, Sample) in order, built as prep's vLLM capture builds them; `cache` keeps them for later epochs and
    evaluations (FeatureCache)."""

    def __init__(self, client, spec: ShardSpec, head, wait_ready: Callable[[], None], cache_bytes: int = 0):
        self.client, self.spec, self.head, self._wait_ready = client, spec, head, wait_ready
        self.cache = FeatureCache(cache_bytes)
        self.requested = 0  # samples the servers computed and training took
        self.dtype = client.spec.dtype
        self.where = client.where
        self._ready = False
        self.agreed = self.checked = 0

    def stream(self, items: list[tuple[int, Rendered]]) -> Iterator[tuple[int, Sample]]:
        from data_prep.vllm_capture import build_sample, head_choice, stream_features

        if not self._ready:  # the servers built while the drafter and DeepSpeed were set up
            self._wait_ready()
            self._ready = True
        by_key = {str(key): (key, r) for key, r in items}
        features = stream_features(self.client, self.spec.tap_layers, self.spec.target["num_layers"],
                                   self.spec.target["hidden_size"],
                                   [(str(key), r.input_ids) for key, r in items])
        try:
            for k, taps, final, engine in features:
                key, r = by_key[k]
                if self.head is not None:  # the prep's head on the teacher against the server's own next token
                    self.checked += 1
                    self.agreed += int(head_choice(self.head, final[-1]) == engine["next_token"])
                self.requested += 1
                yield key, build_sample(r, taps, final, self.spec, self.head)
        finally:
            features.close()

    def generate(self, prompts: list[list[int]], budgets: list[int], stop: tuple[int, ...]) -> list[list[int]]:
        """Each prompt's greedy continuation by the servers (at most its own budget of tokens, ending at a `stop`
        id), all in flight together: the on-policy stage's greedy rollouts (train/on_policy.py ServedTarget)."""
        if not prompts:
            return []
        if not self._ready:
            self._wait_ready()
            self._ready = True
        outs = self.client.generate(prompts, max_tokens=list(budgets), temperature=0.0, stop_token_ids=list(stop))
        return [list(o["token_ids"]) for o in outs]

    def agreement(self) -> float | None:
        """Of the samples received, the share whose last teacher row gives, through the prep's head, the token the
        server itself chose next (prep's `next_token_agreement`): 1.0 when the server computes the prep's target."""
        return self.agreed / self.checked if self.checked else None


def start_node_servers(cfg: RunConfig, spec, run_dir: Path, local_rank: int, local_world: int,
                       stack: ExitStack) -> tuple[list[StartedServer], dict]:
    """Start this rank's share of its node's data.vllm_servers_per_node servers (they build in the background;
    `stack` stops them) and return every server of the job (one all_gather: a collective) and this rank's own
    processes by URL (their exit is seen at once, with vLLM's reason)."""
    import torch.distributed as dist

    from serving.client import VLLM_PLUGIN, serve_args
    from serving.server import VLLMServer, ready

    v, node = cfg.vllm, node_id()
    mine = [s for s in range(cfg.data.vllm_servers_per_node) if s % local_world == local_rank]
    started = []
    if mine:
        python, info = ready(v.python, VLLM_PLUGIN)
        cuda, count = bool(info.get("cuda")), int(info.get("device_count") or 0)
        group = v.tensor_parallel_size * v.pipeline_parallel_size
        for s in mine:
            devices = server_devices(s, group, local_world, count if cuda else 0,
                                     os.environ.get("CUDA_VISIBLE_DEVICES"))
            log_path = run_dir / LOG_NAME.format(node=node, server=s)
            scratch = Path(tempfile.mkdtemp(prefix=f"drafters-train-vllm-s{s}-", dir=_scratch_root(v.scratch_dir)))
            server = stack.enter_context(VLLMServer(python, serve_args(spec, scratch / "spool", cuda),
                                                    log_path=log_path, devices=devices, scratch=scratch,
                                                    startup_timeout_s=v.timeout_s))
            started.append((server, StartedServer(server.url, server.key, str(log_path), node)))
    everyone: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, [asdict(s) for _, s in started])
    else:
        everyone = [[asdict(s) for _, s in started]]
    return [StartedServer(**s) for part in everyone for s in part], {s.url: server for server, s in started}


def _scratch_root(configured: str | None) -> Path:
    from serving.client import scratch_root

    root = scratch_root(configured)
    root.mkdir(parents=True, exist_ok=True)
    return root


def served_sources(cfg: RunConfig, run_dir: Path, rank: int, world: int, stack: ExitStack,
                   should_stop: Callable[[], int], barrier: Callable[[], None] = lambda: None):
    """(train, held-out or None) sample sources of data.source=vllm for this rank (or of data.source=hybrid with
    data.hybrid_from=vllm: epoch 0 from the servers, writing the run's shards, as train/online.py HybridSamples
    does with the transformers target): the prep's rendered splits, the target checked against the prep before any
    server starts, the servers started (or the user's found) and every resource entered into `stack` (servers,
    scratch and connections go when training ends, however)."""
    from data_prep.targets import load_target_config, load_tokenizer, model_path, resolve_target, target_dtype
    from serving.client import Endpoint, ServerSpec, VLLMClient
    from serving.states import engine_layer_ids
    from train.build import load_head
    from train.online import check_target_config, rendered_splits

    d, v = cfg.data, cfg.vllm
    prep = Path(d.dir)
    train_rendered, eval_rendered = rendered_splits(prep)
    if eval_rendered is not None and asdict(eval_rendered.spec) != asdict(train_rendered.spec):
        raise ShardError(f"{prep}/rendered: the train and eval splits were rendered for different captures")
    source = train_rendered.target_source
    ref = d.target or source.model
    where = f"data.target={ref}" if d.target else f"{train_rendered.root / 'spec.json'} (target {ref})"
    preset = resolve_target(ref)
    spec = train_rendered.spec
    check_target_config(load_target_config(preset), load_tokenizer(preset, source.chat_template), spec, where)
    truncate = d.max_len if d.overflow == "truncate" else None
    longest = max(min(n, truncate or n) for part in (train_rendered, eval_rendered) if part is not None
                  for n in part.lengths())
    # rollouts (the on-policy stage) send prompt + continuation, cut at data.max_len, whatever the rendered lengths
    context = max(longest, d.max_len) if cfg.train.on_policy.enabled else longest
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    server_spec = ServerSpec(model=model_path(preset),
                             dtype=target_dtype(preset, source.dtype, "cuda" if torch.cuda.is_available() else "cpu"),
                             max_model_len=context + 1, hidden_size=spec.target["hidden_size"],
                             layer_ids=engine_layer_ids(spec.tap_layers, spec.target["num_layers"]),
                             tensor_parallel_size=v.tensor_parallel_size,
                             pipeline_parallel_size=v.pipeline_parallel_size, engine_kwargs=dict(v.engine_kwargs))
    log_path = run_dir / f"vllm-client.r{rank}.log"
    if v.urls:
        client = VLLMClient(server_spec, v, rank=rank, local_rank=local_rank, local_world=local_world,
                            log_path=log_path, should_stop=should_stop, stop_ends_waits=False)
    else:
        started, mine = start_node_servers(cfg, server_spec, run_dir, local_rank, local_world, stack)
        node = node_id()
        ours = [s for s in started if s.node == node]
        share = ours[local_rank::local_world] if len(ours) >= local_world else [ours[local_rank % len(ours)]]
        client = VLLMClient(server_spec, v, rank=rank, log_path=log_path, should_stop=should_stop,
                            stop_ends_waits=False,
                            started=[Endpoint(s.url, s.key, where=s.where(), server=mine.get(s.url)) for s in share])
    stack.enter_context(client)

    def ready() -> None:
        client.wait_ready()  # every server healthy, serving the prep's target at the length needed

    head = load_head(prep) if spec.teacher != "hidden" else None
    features = ServedFeatures(client, spec, head, ready, int(d.vllm_cache_gb * 2**30))
    held_out = ServedSamples(eval_rendered, features, truncate) if eval_rendered is not None else None
    if d.source == "hybrid":
        from train.online import CAPTURED_DIR, HybridSamples

        return HybridSamples(ServedSamples(train_rendered, features), run_dir / CAPTURED_DIR / "train", rank, world,
                             d.hybrid_tokens_per_shard, d.verify, barrier, d.batch_size // world), held_out
    return ServedSamples(train_rendered, features, truncate), held_out
