"""DiLoCoConfig: every DiLoCo knob as a `TrainingArguments` field.

Design choices:
- One dataclass extending `TrainingArguments`, so HfArgumentParser turns each field into a CLI flag and a YAML key
  with no extra code, and `DiLoCoTrainer` takes it wherever `Trainer` takes its arguments.
- Defaults are the DiLoCo paper's (arXiv 2311.08105): H = 500, outer SGD lr 0.7, momentum 0.9, Nesterov.
- Trainer settings that would add a collective to every inner step are switched off here, because replicas must
  not talk between syncs: `average_tokens_across_devices` is forced off and per-step token counting is refused.
- Checkpoints and evaluations only happen on round boundaries: a `save_steps`/`eval_steps` that falls inside a
  round is postponed to the end of that round (the trainer logs a notice once). Evaluating or saving mid-round
  would measure or store one replica's private parameters instead of the global model.
- The allowed range of each field lives in hf_diloco.checks, which the app's form asks too; this module keeps the
  rules that relate several fields. It imports no backend: torchft is looked for, not imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from transformers import TrainingArguments

from . import checks
from .checks import (
    CHECK_MODES,
    DATA_SHARDINGS,
    FINAL_SYNCS,
    FRAGMENT_PATTERNS,
    INNER_OPTIMIZERS,
    OUTER_BACKENDS,
    OUTER_OPTIMIZERS,
    OVERLAP_LANDINGS,
    TRAINERS,
)
from .codecs import CODECS
from .errors import ConfigError, first_line  # noqa: F401  (re-exported: the config layer's errors)
from .tasks import TASKS


def launched_processes() -> int:
    """Processes in this launch as torchrun/accelerate or an MPI launcher tells them; 0 outside a launch."""
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def _launched_on_cpu_only() -> bool:
    """True when several processes were launched and there is no GPU for them."""
    import torch

    return launched_processes() > 1 and not torch.cuda.is_available()


def _has_accelerator() -> bool:
    """True where torch sees an accelerator (a CUDA, ROCm, XPU or MPS device)."""
    import torch

    return torch.cuda.is_available() or torch.accelerator.is_available()


AUTO_START = 20  # H of the measuring rounds of `inner_steps: auto`
AUTO_DELAY_START = 1  # τ of every fragment until its first exchange is measured (`sync_delay: auto`)


@dataclass
class DiLoCoConfig(TrainingArguments):
    """`TrainingArguments` plus the DiLoCo outer loop.

    >>> config = DiLoCoConfig(output_dir="out", inner_steps=50, outer_lr=0.7)
    >>> config.inner_steps
    50
    """

    inner_steps: int = field(
        default=500,
        metadata={"help": "H: inner optimizer steps each replica takes between two outer syncs (paper: 500). 'auto' "
                          f"(in a recipe, a flag or from Python): start at H = {AUTO_START} and choose H from the "
                          "first rounds (auto_inner_steps)."},
    )
    auto_inner_steps: bool = field(
        default=False,
        metadata={"help": "Choose H from measurements: the first two rounds (of every fragment) run with "
                          "inner_steps, then H becomes the smallest multiple of num_fragments for which the time "
                          "the replicas wait for syncs stays under max_sync_overhead of their compute time "
                          "(H = F * sync seconds / (max_sync_overhead * seconds per step)); the round record and "
                          "the log give the choice and the numbers behind it. inner_steps: auto sets it."},
    )
    max_sync_overhead: float = field(
        default=0.05,
        metadata={"help": "auto_inner_steps: the most time spent waiting for syncs, as a fraction of compute time."},
    )
    outer_lr: float = field(
        default=0.7,
        metadata={"help": "Learning rate of the outer optimizer applied to the averaged pseudo-gradient (paper: 0.7)."},
    )
    outer_momentum: float = field(
        default=0.9,
        metadata={"help": "Momentum of the outer SGD optimizer; for outer_optimizer=adamw it is beta1 (paper: 0.9)."},
    )
    outer_nesterov: bool = field(
        default=True,
        metadata={"help": "Use Nesterov momentum in the outer SGD optimizer (paper: true)."},
    )
    outer_momentum_delay: int = field(
        default=1,
        metadata={"help": "Move the outer momentum only every this many syncs of a parameter, from the mean of their "
                          "pseudo-gradients, and apply each pseudo-gradient alone (times outer_delayed_scale) in "
                          "between: the delayed Nesterov of Asynchronous Local-SGD (arXiv 2401.09135), for replicas "
                          "of unequal speed (round_seconds) whose single merges are small or stale. 1: plain "
                          "Nesterov. Needs outer_optimizer sgd with outer_momentum > 0."},
    )
    outer_delayed_scale: float = field(
        default=1.0,
        metadata={"help": "With outer_momentum_delay N > 1: the factor c on each pseudo-gradient applied at every sync "
                          "(θ ← θ − lr·c·Δ); 1/N makes N syncs together move like one Nesterov step on their mean."},
    )
    outer_momentum_restart: int = field(
        default=0,
        metadata={"help": "Start the outer momentum afresh every this many syncs of a parameter: the sync after a "
                          "restart builds it from its own averaged pseudo-gradient alone (outer-momentum restarts, "
                          "arXiv 2605.28585: stale momentum dropped, the inner steps' progress kept). 0: never. "
                          "Needs outer_optimizer sgd with outer_momentum above 0 and outer_momentum_delay 1."},
    )
    outer_optimizer: str = field(
        default="sgd",
        metadata={"help": "Outer optimizer: 'sgd' (the paper's choice) or 'adamw' (for ablations).",
                  "choices": list(OUTER_OPTIMIZERS)},
    )
    inner_optimizer: str = field(
        default="adamw",
        metadata={"help": "What each replica trains with between syncs: 'adamw' (Trainer's own optimizer, as `optim` "
                          "sets it: AdamW by default) or 'muon' (Muon for the weight matrices, AdamW for embeddings, "
                          "heads and vectors; the learning rate, schedule and weight decay serve both). Muon needs "
                          "whole matrices in each process: not with FSDP2 or tensor parallel inside a replica.",
                  "choices": list(INNER_OPTIMIZERS)},
    )
    offload_outer_state: bool = field(
        default=True,
        metadata={"help": "Keep the fp32 global parameters and outer optimizer state on CPU, so DiLoCo costs no "
                          "accelerator memory; when false they live on the model's device."},
    )
    replica_group_size: int = field(
        default=1,
        metadata={"help": "Processes per replica. 1: every process is a replica. g > 1: each g consecutive processes "
                          "form one replica (e.g. one machine's GPUs) that trains with DDP inside it, or shards the "
                          "model over them with FSDP2 when FSDP is on (fsdp: true, "
                          "or an accelerate config with distributed_type FSDP); DiLoCo runs across replicas and each "
                          "member syncs only its 1/g slice or shard. Default with an accelerate parallelism_config: "
                          "its dp_shard_size × tp_size."},
    )
    tp_size: int = field(
        default=1,
        metadata={"help": "Tensor parallel inside each replica: its tp_size processes split every attention and MLP "
                          "layer's weights (the model's own tensor-parallel plan, applied by transformers), and each "
                          "syncs its own pieces with the same-rank process of every other replica. Sets "
                          "replica_group_size; with FSDP, replica_group_size / tp_size processes shard each piece "
                          "(FSDP2 + tensor parallel in one replica). Default with an accelerate parallelism_config: "
                          "its tp_size."},
    )
    data_sharding: str = field(
        default="iid",
        metadata={"help": "'iid': each replica reads every M-th batch of one seeded shuffle of the data; 'non_iid': "
                          "replica r reads only the r-th contiguous slice of the corpus (for the built-in corpus, "
                          "its own set of topics), as in the paper's non-i.i.d. experiment.",
                  "choices": list(DATA_SHARDINGS)},
    )
    sync_bucket_mb: float = field(
        default=256.0,
        metadata={"help": "Largest fp32 pseudo-gradient bucket, in MB. A sync forms, sends, receives and applies one "
                          "bucket before the next, so its extra memory is a few buckets whatever the model's size "
                          "(two without compression: the replica's and the averaged pseudo-gradient; up to five "
                          "with a dense codec's payloads and decoded copies). With sync_delay > 0 the fragment in "
                          "flight is held whole."},
    )
    compression: str = field(
        default="none",
        metadata={"help": "Codec for the pseudo-gradient on the wire: 'none' (fp32 all-reduce), 'bf16', 'fp16', "
                          "'int8' or 'int4' (one fp32 scale per compression_chunk values; sent as a quantized "
                          "reduce-scatter + all-gather, about 2x the encoded size per process whatever the number "
                          "of replicas), or 'sparse' (top sparse_k of every sparse_chunk values at sparse_bits "
                          "bits, all-gathered). Decoded values are always applied in fp32.",
                  "choices": list(CODECS)},
    )
    compression_chunk: int = field(
        default=1024,
        metadata={"help": "Values per fp32 scale for int8/int4 (1024: int8 sends 1.004 bytes a value, int4 0.504)."},
    )
    sparse_k: int = field(default=64, metadata={"help": "sparse: values kept in every sparse_chunk (SparseLoCo: 64)."})
    sparse_chunk: int = field(
        default=4096, metadata={"help": "sparse: values per chunk; positions are packed in log2(chunk) bits."}
    )
    sparse_bits: int = field(
        default=2, metadata={"help": "sparse: bits per kept value, one of them the sign (SparseLoCo: 2)."}
    )
    error_feedback: bool = field(
        default=False,
        metadata={"help": "Keep, per replica, what the codec failed to send and add it to the next pseudo-gradient "
                          "(e <- decay*e + delta; send C(e); e <- e - C(e)). Recommended for int4 and sparse."},
    )
    error_feedback_decay: float = field(
        default=1.0,
        metadata={"help": "Decay of the error-feedback residual in (0, 1] (1: nothing forgotten; SparseLoCo: 0.95)."},
    )
    num_fragments: int = field(
        default=1,
        metadata={"help": "Streaming DiLoCo: sync the model in F fragments, one every inner_steps/F steps, each "
                          "fragment once per inner_steps (peak bandwidth drops F-fold). With F > 1, fragment 0 holds "
                          "the non-layer parameters (embeddings, final norm, head) and the layers are spread over "
                          "the other F-1 (over all F when every parameter is in a layer, as a LoRA model's "
                          "adapters are). inner_steps must be a multiple of F, and F at most what the layers allow."},
    )
    fragment_pattern: str = field(
        default="strided",
        metadata={"help": "How layers are assigned to fragments: 'strided' (layer l -> fragment 1 + l mod (F-1), "
                          "the paper's better choice) or 'sequential' (contiguous runs of layers).",
                  "choices": list(FRAGMENT_PATTERNS)},
    )
    sync_delay: int | None = field(
        default=None,
        metadata={"help": "tau: inner steps a sync runs in the background before its outer step is applied (0: "
                          "blocking). Must be below inner_steps/num_fragments; the paper finds tau < 5 robust. "
                          f"'auto' (in a recipe, a flag or from Python): start at tau = {AUTO_DELAY_START} and choose "
                          "each fragment's tau from its measured exchanges (auto_sync_delay). Unset: 1 with "
                          "round_seconds (a replica that spent its budget trains on while the others arrive and the "
                          "exchange runs, and the sync lands at the first step after its exchange is done; costs a "
                          "copy of the pseudo-gradient while in flight, and with the mix landing at alpha 0 the steps "
                          "taken in flight are dropped), 0 with rounds of H steps and with contribution_loss_check "
                          "(which scores a blocking round)."},
    )
    auto_sync_delay: bool = field(
        default=False,
        metadata={"help": "Choose each fragment's tau from measurements: after every sync, the fragment that synced "
                          "in the sync before takes the fewest inner steps (1 to inner_steps/num_fragments - 1) "
                          "whose compute time covers its exchange, the longest any replica measured, and a fragment "
                          "not measured yet what that exchange scaled by its size would need (the numbers "
                          "ride with the sync's statistics, so every replica chooses alike); the sync's record "
                          "gives each choice and the numbers behind it. sync_delay: auto sets it."},
    )
    final_sync: str = field(
        default="auto",
        metadata={"help": "How the run's end makes the final model global. 'staggered': each fragment's last sync "
                          "overlaps like the others, launched so that it lands as the next is launched and the last "
                          "lands at the last step (nothing waits at the end; what a fragment trains after its last "
                          "launch, at most the sum of the fragments' tau in steps, is left out of the final model). "
                          "'blocking': every fragment syncs at the last step and the replicas wait for the whole "
                          "model's exchange. 'auto': staggered when syncs overlap (sync_delay > 0) on the torch "
                          "backend with rounds of H steps, else blocking. On torchft and with round_seconds the end "
                          "is always blocking: syncs are due by each replica's own progress, not at fixed steps, so "
                          "there is no fixed window to stagger the last syncs in.",
                  "choices": list(FINAL_SYNCS)},
    )
    fragment_alpha: float = field(
        default=0.0,
        metadata={"help": "When a sync lands, theta_local <- alpha*theta_local + (1-alpha)*theta_global, for every "
                          "kind of sync: blocking, overlapped or voted (0: take the global parameters; Streaming "
                          "DiLoCo's overlap runs use 0.5). A replica that sat the sync out takes the global ones, and "
                          "the syncs landing at the last step use 0, so the final model is the global one."},
    )
    overlap_landing: str = field(
        default="mix",
        metadata={"help": "How an overlapped sync (sync_delay > 0) lands on the replica. 'mix': theta_local <- "
                          "alpha*theta_local + (1-alpha)*theta_global (fragment_alpha; the inner steps taken while "
                          "the sync was in flight are dropped at alpha 0). 'eager': theta_local <- theta_global + "
                          "(theta_local - theta_local at launch): those steps stay on top of the new global "
                          "parameters, standing in for this replica's share of them until its next sync merges them "
                          "(the local stand-in of eager updates, arXiv 2502.12996; theta_global stays identical on "
                          "every replica). Each sync in flight then holds a copy of its fragments' parameters as "
                          "they were at launch (fp32, beside theta_global). Needs sync_delay >= 1 or auto and "
                          "fragment_alpha 0; a sync that does not overlap (the last) lands as 'mix'.",
                  "choices": list(OVERLAP_LANDINGS)},
    )

    save_every_rounds: int = field(
        default=1,
        metadata={"help": "Save a checkpoint every this many rounds (0: only where save_strategy says), whatever "
                          "save_strategy is, so a process that dies loses at most that many rounds. Checkpoints are "
                          "atomic; unless save_total_limit is set, the newest 2 are kept."},
    )
    sync_timeout: float = field(
        default=600.0,
        metadata={"help": "Seconds a sync waits for the other replicas before the run stops with an error naming the "
                          "replicas that did not arrive and the step each was last seen at (the backend's own "
                          "default is 30 minutes)."},
    )
    max_bad_rounds: int = field(
        default=3,
        metadata={"help": "A replica whose pseudo-gradient holds NaN or Inf sits its round out (the others are "
                          "averaged without it) and restarts from the global parameters; when no replica is "
                          "healthy the outer step is skipped; a sync whose average is not finite though every "
                          "replica reported finite values, or with a merge weight outside 0..1, is refused (a "
                          "replica that lies); after this many such rounds in a row the run stops with an error."},
    )

    contribution_checks: str = field(
        default="exclude",
        metadata={"help": "Check every replica's pseudo-gradient before it is merged (its norm against the learning "
                          "rate and the others', its agreement with the others; docs/guides/contributions.md). "
                          "exclude: a replica found out is left out of the sync (weight 0) and named in "
                          "the record's `excluded`; warn: named in `flagged` and on the console, still merged; off: "
                          "no checks (and no check exchange on the torch backend)."},
    )
    contribution_adam_ratio: float = field(
        default=2.0,
        metadata={"help": "Contribution check `size` (AdamW-family inner optimizers, and muon): leave out a replica "
                          "whose pseudo-gradient norm is more than this many times √P·steps·η (P values synced, η the "
                          "agreed mean learning rate over its steps)."},
    )
    contribution_norm_ratio: float = field(
        default=2.3,
        metadata={"help": "Contribution check `outlier` (3 or more replicas): leave out a replica whose "
                          "pseudo-gradient norm is more than this many times the median replica's."},
    )
    contribution_min_agreement: float = field(
        default=-0.3,
        metadata={"help": "Contribution check `opposed` (3 or more replicas): leave out a replica whose leave-one-out "
                          "agreement cos(Δ_i, Σ_{j≠i} w_j Δ_j) in its last sync was below this."},
    )
    contribution_agreement_gap: float = field(
        default=0.35,
        metadata={"help": "Contribution check `apart` (3 or more replicas): leave out a replica whose leave-one-out "
                          "agreement was this far below the others' median in each of its last two syncs."},
    )
    contribution_loss_check: bool = field(
        default=False,
        metadata={"help": "Also score each replica's round by the loss it removes on a held-out batch (the same "
                          "`contribution_loss_batch` examples on every replica): its parameters against the global "
                          "ones the round started from, two forward passes a sync. A replica whose round raised that "
                          "loss by more than `contribution_loss_margin` while the median replica's did not is left out "
                          "(rule `loss`; works at 2 replicas). Needs num_fragments 1, sync_delay 0, fragment_alpha 0 "
                          "and an evaluation set."},
    )
    contribution_loss_batch: int = field(
        default=8,
        metadata={"help": "Held-out examples the loss check scores each round on (the evaluation set's first)."},
    )
    contribution_loss_margin: float = field(
        default=0.05,
        metadata={"help": "The loss check leaves out a replica whose round raised the held-out batch's loss by more "
                          "than this (nats) below what the median replica's did."},
    )
    contribution_faulty_after: int = field(
        default=3,
        metadata={"help": "A replica left out of this many syncs in a row is reported faulty on the console (it "
                          "stays in the run at weight 0 and is taken back once its numbers agree again)."},
    )

    outer_backend: str = field(
        default="torch",
        metadata={"help": "torch: a fixed set of replicas started by one launch, a round is a barrier over all of "
                          "them. torchft: each replica is its own launch and joins through a torchft Lighthouse; a "
                          "round merges the replicas that arrived, a dead replica is left out and a new or restarted "
                          "one heals from a live peer (needs pip install -e '.[ft]')."},
        # choices: torch, torchft
    )
    lighthouse: str = field(
        default="",
        metadata={"help": "torchft: the Lighthouse address, http://HOST:PORT (default: $TORCHFT_LIGHTHOUSE)."},
    )
    replica_id: int = field(
        default=0, metadata={"help": "torchft: this launch's replica number, 0 .. num_replicas-1 (its data shard)."}
    )
    num_replicas: int = field(
        default=1,
        metadata={"help": "torchft: replicas the training data is split among (each launch reads shard replica_id)."},
    )
    min_replicas: int = field(
        default=1,
        metadata={"help": "torchft: a round commits only with at least this many replicas (the Lighthouse's "
                          "--min-replicas must match)."},
    )
    sync_grace_seconds: float = field(
        default=5.0,
        metadata={"help": "torchft: once min_replicas have arrived, a round waits at most this long for the other "
                          "live replicas (the Lighthouse's join timeout: `hf-diloco launch --replicas` starts its "
                          "Lighthouse with it; give `hf-diloco lighthouse --grace-seconds` the same)."},
    )
    group_timeout: float = field(
        default=15.0,
        metadata={"help": "torchft: seconds the replicas of a new quorum get to connect to one another before the "
                          "sync is given up (it rolls back; the others join the next sync without the missing one), "
                          "so a replica that dies after joining a quorum costs the others this long, not "
                          "sync_timeout. Once the group has formed, each collective waits at most 4 times the "
                          "longest exchange of the last 8 committed syncs, at least group_timeout and at most "
                          "sync_timeout (sync_timeout until a sync has committed; doubled after each sync in a row "
                          "that did not commit), so a replica cut off inside an exchange costs the others that long "
                          "too: the sync rolls back and the next forms without it."},
    )
    round_seconds: float = field(
        default=0.0,
        metadata={"help": "End each round after this many seconds of inner steps instead of after H steps, so a "
                          "slower replica takes fewer steps instead of making the others wait (0: off). The run still "
                          "ends at max_steps, counted by the furthest replica: after each sync every replica "
                          "continues at its step, and the merge weights each replica by the tokens it trained. Each "
                          "replica overlaps a sync with its own steps (sync_delay, 1 unless set: it lands once its "
                          "exchange is done; auto: as many as cover the exchange at its own speed, and a budget too "
                          "short for the exchange stretches until the exchanges fit again; sync_delay 0 blocks)."},
    )
    replica_address: str = field(
        default="",
        metadata={"help": "torchft: the address peers reach this replica at for healing and the sync, and the only "
                          "one its listeners bind: manager, store, healing transfer, and gloo through the interface "
                          "that holds the address unless GLOO_SOCKET_IFNAME names one (default: this machine's host "
                          "name; `launch --replicas` on one machine: 127.0.0.1)."},
    )
    end_linger_seconds: float = field(
        default=60.0,
        metadata={"help": "torchft: after the run's last round, how long a replica stays to hand the final model "
                          "to replicas that missed that round (a restarted or late one heals from it, learns the run "
                          "is over and ends with the same model); it leaves as soon as every replica it has seen "
                          "has had it (0: leave at once)."},
    )

    def __post_init__(self):
        self._validate_diloco_fields()
        self._validate_backend()
        # Trainer gathers every step's token count across processes when this is on. DiLoCo replicas do not
        # talk between syncs, so each replica normalises its loss by its own tokens.
        self.average_tokens_across_devices = False
        if self.include_num_input_tokens_seen not in (False, "no", None):
            raise ConfigError(
                "include_num_input_tokens_seen gathers a token count from every replica at every step, which DiLoCo "
                "forbids; leave it off (tokens per round are reported in syncs.jsonl instead)."
            )
        if not self.use_cpu and (self.bf16 or self.bf16_full_eval or self.tf32) and not _has_accelerator():
            # A recipe written for GPUs, run where there is none: bf16 becomes bfloat16 autocast on the CPU (the run
            # says so when it starts) and tf32, a matmul mode of NVIDIA GPUs, has nothing to act on.
            self.use_cpu, self.tf32 = True, None
        if not self.use_cpu and _launched_on_cpu_only():
            # Under `accelerate launch --multi_gpu` on a machine without GPUs, TrainingArguments would otherwise
            # see a single process and every replica would train the same data alone; use_cpu makes it a gloo
            # MULTI_CPU run with one replica per process.
            self.use_cpu = True
        if self.use_cpu or not _has_accelerator():
            # Pinned host memory only speeds up copies to an accelerator; without one torch's DataLoader warns on
            # every process that it cannot pin.
            self.dataloader_pin_memory = False
        from . import compat

        compat.env_rendezvous_store_on_its_address()  # (MPI's launch: rank 0 serves the store, on MASTER_ADDR only)
        super().__post_init__()
        # With an iterable (streaming) dataset Accelerate would otherwise read every batch on rank 0 and send it
        # to the other processes at every step; each replica reads its own shard instead.
        self.accelerator_config.dispatch_batches = False

    def __getstate__(self) -> dict:
        """What a pickle of these arguments holds: every attribute, with a token (`hub_token`) left out as `to_dict`
        leaves it out. Trainer pickles its arguments into `training_args.bin` beside the model and in every
        checkpoint, so a run's folder holds no Hub token however it was given."""
        return {name: None if name.endswith("_token") else value for name, value in self.__dict__.items()}

    def _budgets_overlap(self) -> bool:
        """Whether an unset sync_delay is 1: time-budget rounds whose H/F leaves room for τ, without
        contribution_loss_check (whose score needs a blocking round). Values of the wrong kind are refused later."""
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool)
                      for v in (self.round_seconds, self.inner_steps, self.num_fragments))
        return numbers and self.round_seconds > 0 and self.num_fragments > 0 and not self.contribution_loss_check \
            and self.inner_steps // self.num_fragments > AUTO_DELAY_START

    def _validate_backend(self) -> None:
        if self.outer_backend not in OUTER_BACKENDS:
            raise ConfigError(f"outer_backend must be torch or torchft, got {self.outer_backend!r}.")
        if self.outer_backend == "torchft":
            checks.check_torchft(self)
            checks.require_torchft()

    def _validate_diloco_fields(self) -> None:
        if self.inner_steps == "auto":
            self.inner_steps, self.auto_inner_steps = AUTO_START, True
        if self.sync_delay is None:  # unset: time budgets overlap (τ 1: each sync lands once its exchange is
            # done, from the first step after its launch), rounds of H steps block
            self.sync_delay = 1 if self._budgets_overlap() else 0
        checks.check(self, ["inner_steps", *(["max_sync_overhead"] if self.auto_inner_steps else [])])
        if self.auto_inner_steps and self.outer_backend == "torchft":
            raise ConfigError("outer_backend torchft sizes its rounds with round_seconds, not auto_inner_steps; set "
                              "round_seconds instead.")
        checks.check(self, ["outer_lr", "outer_momentum"])
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError(
                f"outer_optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, got {self.outer_optimizer!r}."
            )
        checks.check(self, ["outer_momentum_delay", "outer_delayed_scale", "outer_momentum_restart"])
        if self.outer_momentum_restart and (self.outer_optimizer != "sgd" or self.outer_momentum == 0
                                            or self.outer_momentum_delay > 1):
            raise ConfigError("outer_momentum_restart restarts the outer SGD's momentum, so it needs outer_optimizer "
                              "sgd with outer_momentum above 0 and outer_momentum_delay 1; set "
                              "outer_momentum_restart 0 or change those.")
        if self.outer_momentum_delay > 1 and (self.outer_optimizer != "sgd" or self.outer_momentum == 0):
            raise ConfigError("outer_momentum_delay delays the outer SGD's momentum, so it needs outer_optimizer sgd "
                              "with outer_momentum above 0; set outer_momentum_delay 1 or change those.")
        if self.outer_nesterov and self.outer_optimizer == "sgd" and self.outer_momentum == 0:
            # torch's SGD refuses Nesterov without momentum; plain SGD is what the user means.
            self.outer_nesterov = False
        checks.check(self, ["replica_group_size"])
        # Only inside a launched process is the process count known (`hf-diloco launch` checks its config).
        processes = launched_processes()
        if processes and processes % self.replica_group_size:
            raise ConfigError(
                f"replica_group_size={self.replica_group_size} does not divide the {processes} launched processes; "
                f"launch a multiple of it."
            )
        if self.data_sharding not in DATA_SHARDINGS:
            raise ConfigError(
                f"data_sharding must be one of {', '.join(DATA_SHARDINGS)}, got {self.data_sharding!r}."
            )
        checks.check(self, ["sync_bucket_mb", "save_every_rounds", "sync_timeout", "max_bad_rounds"])
        if self.contribution_checks not in CHECK_MODES:
            raise ConfigError(f"contribution_checks must be one of {', '.join(CHECK_MODES)}, got "
                              f"{self.contribution_checks!r}.")
        checks.check(self, ["contribution_adam_ratio", "contribution_norm_ratio", "contribution_min_agreement",
                            "contribution_agreement_gap", "contribution_faulty_after", "contribution_loss_batch",
                            "contribution_loss_margin"])
        if self.contribution_loss_check and (self.num_fragments != 1 or self.sync_delay != 0 or
                                             self.fragment_alpha != 0 or self.contribution_checks == "off"):
            raise ConfigError(
                "contribution_loss_check scores a round against the global parameters it started from, so it needs "
                "num_fragments 1, sync_delay 0, fragment_alpha 0 and contribution_checks exclude or warn; got "
                f"num_fragments {self.num_fragments}, sync_delay {self.sync_delay}, fragment_alpha "
                f"{self.fragment_alpha}, contribution_checks {self.contribution_checks}.")
        if self.save_every_rounds and self.save_total_limit is None:
            self.save_total_limit = 2
        self._validate_compression()
        self._validate_streaming()
        self._check_sharded_replicas()
        self._validate_inner_optimizer()
        checks.check(self, ["learning_rate"])

    def _validate_inner_optimizer(self) -> None:
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise ConfigError(f"inner_optimizer must be one of {', '.join(INNER_OPTIMIZERS)}, got "
                              f"{self.inner_optimizer!r}.")
        if self.inner_optimizer == "muon" and (self.sharded_replica or self.tensor_parallel):
            raise ConfigError("inner_optimizer muon orthogonalizes each whole weight matrix, and with "
                              f"{'FSDP2' if self.sharded_replica else 'tensor parallel'} inside a replica each "
                              "process holds a piece of it; use DDP inside the replica (replica_group_size without "
                              "fsdp or tp_size) or inner_optimizer adamw.")

    def _validate_compression(self) -> None:
        if self.compression not in CODECS:
            raise ConfigError(f"compression must be one of {', '.join(CODECS)}, got {self.compression!r}.")
        checks.check(self, ["compression_chunk", "sparse_chunk"])
        if not isinstance(self.sparse_k, int) or not 1 <= self.sparse_k <= self.sparse_chunk:
            raise ConfigError(
                f"sparse_k must be between 1 and sparse_chunk={self.sparse_chunk}, got {self.sparse_k!r}."
            )
        checks.check(self, ["sparse_bits", "error_feedback_decay"])
        if self.error_feedback and self.compression == "none":
            raise ConfigError(
                "error_feedback needs a lossy compression (bf16, fp16, int8, int4 or sparse); with 'none' nothing "
                "is lost to feed back."
            )

    def _validate_streaming(self) -> None:
        if self.sync_delay == "auto":
            self.sync_delay, self.auto_sync_delay = AUTO_DELAY_START, True
        checks.check(self, ["sync_delay", "num_fragments"])
        if self.auto_sync_delay and self.sync_delay < 1:
            raise ConfigError("auto_sync_delay chooses how many inner steps each sync overlaps, so it starts from "
                              f"sync_delay {AUTO_DELAY_START} or more; set sync_delay: auto.")
        fragments, delay = self.num_fragments, self.sync_delay
        if self.inner_steps % fragments:
            raise ConfigError(
                f"inner_steps={self.inner_steps} must be a multiple of num_fragments={fragments}, so that one "
                f"fragment syncs every inner_steps/num_fragments steps."
            )
        if self.fragment_pattern not in FRAGMENT_PATTERNS:
            raise ConfigError(
                f"fragment_pattern must be one of {', '.join(FRAGMENT_PATTERNS)}, got {self.fragment_pattern!r}."
            )
        if delay >= self.inner_steps // fragments:
            raise ConfigError(
                f"sync_delay={delay} must be below inner_steps/num_fragments={self.inner_steps // fragments}, so a "
                f"fragment's sync lands before the next one starts."
            )
        checks.check(self, ["fragment_alpha"])
        if self.overlap_landing not in OVERLAP_LANDINGS:
            raise ConfigError(f"overlap_landing must be one of {', '.join(OVERLAP_LANDINGS)}, got "
                              f"{self.overlap_landing!r}.")
        if self.overlap_landing == "eager" and (delay < 1 or self.fragment_alpha != 0):
            raise ConfigError("overlap_landing eager keeps the inner steps taken while a sync is in flight, so it "
                              "needs sync_delay 1 or more (or auto) and fragment_alpha 0 (which mixes them instead); "
                              f"got sync_delay {delay}, fragment_alpha {self.fragment_alpha}.")
        if self.final_sync not in FINAL_SYNCS:
            raise ConfigError(f"final_sync must be one of {', '.join(FINAL_SYNCS)}, got {self.final_sync!r}.")
        if self.final_sync == "staggered" and delay < 1:
            raise ConfigError("final_sync staggered overlaps each fragment's last sync with inner steps, so it needs "
                              "sync_delay 1 or more (or auto).")
        checks.check(self, ["round_seconds"])
        if self.round_seconds > 0:
            self._check_time_budget()
        if self.final_sync == "staggered" and self.outer_backend == "torchft":
            raise ConfigError("final_sync staggered needs outer_backend torch: torchft rounds are due by each "
                              "replica's own progress, not at fixed steps, so its last round syncs every fragment.")

    def _check_time_budget(self) -> None:
        """What time-budget rounds do not combine with."""
        for name in ("eval_strategy", "save_strategy"):
            if getattr(self, name) == "epoch":
                raise ConfigError(f"round_seconds counts saves and evaluations in steps (its replicas reach an "
                                  f"epoch's end at different times): set {name} to steps or no.")
        if self.final_sync == "staggered":
            raise ConfigError("final_sync staggered places each fragment's last sync at a fixed step, which "
                              "round_seconds does not have (the run ends when a replica reaches max_steps): set "
                              "final_sync auto or blocking.")
        if self.outer_backend != "torch":
            return
        if self.auto_inner_steps:
            raise ConfigError("round_seconds sizes each round by time, so it does not combine with inner_steps auto; "
                              "set one of them.")

    @property
    def staggered_end(self) -> bool:
        """Whether each fragment's last sync overlaps inner steps (see final_sync)."""
        if self.final_sync == "auto":
            return self.sync_delay > 0 and self.outer_backend == "torch" and self.round_seconds == 0
        return self.final_sync == "staggered"

    @property
    def tensor_parallel(self) -> bool:
        """True when each replica splits its layers over its processes with tensor parallel (tp_size > 1)."""
        return self.tp_size > 1

    def _check_tensor_parallel(self, from_env: int) -> None:
        """Set tp_size (and replica_group_size) from an accelerate parallelism_config's tp_size, or refuse a layout
        tensor parallel cannot run in, in one sentence."""
        checks.check(self, ["tp_size"])
        if from_env > 1 and self.tp_size not in (1, from_env):
            raise ConfigError(f"tp_size={self.tp_size} differs from the accelerate parallelism_config's tp_size="
                              f"{from_env}; set one of them, or both alike.")
        self.tp_size = max(self.tp_size, from_env)
        if self.tp_size == 1 or self.sharded_replica:  # FSDP2 + tensor parallel: see _check_sharded_replicas
            return
        if self.replica_group_size == 1:
            self.replica_group_size = self.tp_size
        elif self.replica_group_size != self.tp_size:
            raise ConfigError(f"replica_group_size={self.replica_group_size} differs from tp_size={self.tp_size}: a "
                              f"tensor-parallel replica is its tp_size processes; set one of them, or both alike.")

    @property
    def sharded_replica(self) -> bool:
        """True when each replica shards its model over its processes with FSDP2 instead of DDP inside it."""
        return bool(self.fsdp) or _env_flag("ACCELERATE_USE_FSDP")

    def _check_sharded_replicas(self) -> None:
        """FSDP2 shards the model inside each replica only (DiLoCo replaces its replicate dimension); FSDP1 and
        DeepSpeed cannot do that here, so they are refused in one sentence each."""
        if isinstance(self.fsdp, str) and self.fsdp.lower() in ("true", "false", "yes", "no", "1", "0", ""):
            self.fsdp = self.fsdp.lower() in ("true", "yes", "1")  # `--fsdp true` on the command line
        if self.deepspeed or _env_flag("ACCELERATE_USE_DEEPSPEED"):
            raise ConfigError(
                "DeepSpeed ZeRO would shard one model across the DiLoCo replicas and hf-diloco cannot confine it to "
                "each replica; use FSDP2 inside each replica instead (fsdp: true with replica_group_size > 1, or "
                "accelerate_configs/cpu-fsdp-2x2.yaml)."
            )
        layout = env_parallelism()
        self._check_tensor_parallel(layout["tp"])
        if layout["shard"] > 1:
            if self.tensor_parallel and not self.sharded_replica:
                raise ConfigError(
                    f"the accelerate parallelism_config shards each replica over dp_shard_size={layout['shard']} "
                    f"processes beside tp_size={self.tp_size}, which needs FSDP: set distributed_type FSDP with "
                    f"fsdp_version 2 (see accelerate_configs/cpu-fsdp-tp-2x4.yaml)."
                )
            group = layout["shard"] * self.tp_size
            if self.replica_group_size == 1:
                self.replica_group_size = group
            elif self.replica_group_size != group:
                raise ConfigError(
                    f"replica_group_size={self.replica_group_size} differs from the accelerate parallelism_config's "
                    f"dp_shard_size={layout['shard']}" + (f" × tp_size={self.tp_size}" if self.tensor_parallel else "")
                    + f" = {group}, the processes of each replica; set one of them, or both alike."
                )
        if not self.sharded_replica:
            return
        options = self.fsdp_config if isinstance(self.fsdp_config, dict) else {}
        version = options.get("version", 2) if self.fsdp else os.environ.get("FSDP_VERSION", "1")
        if str(version) != "2":
            raise ConfigError(
                "FSDP inside a DiLoCo replica needs FSDP2: set fsdp_version: 2 in the accelerate config (or leave "
                "fsdp_config's version at its default, 2)."
            )
        if self.replica_group_size < 2:
            raise ConfigError(
                "FSDP runs inside each DiLoCo replica, and a replica of one process has nothing to shard over: set "
                "replica_group_size to the processes of each replica (2 or more), or turn FSDP off."
            )
        if self.tensor_parallel and (self.replica_group_size % self.tp_size or self.dp_shard_size < 2):
            raise ConfigError(
                f"FSDP2 with tensor parallel shards each replica over replica_group_size / tp_size processes, so "
                f"replica_group_size must be tp_size={self.tp_size} times 2 or more (e.g. {2 * self.tp_size}), got "
                f"{self.replica_group_size}."
            )

    @property
    def dp_shard_size(self) -> int:
        """The processes of a replica FSDP2 shards each value over: replica_group_size / tp_size with FSDP (the rest
        of the replica is its tensor-parallel dimension), 1 without."""
        return self.replica_group_size // self.tp_size if self.sharded_replica else 1


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true")


def env_parallelism() -> dict[str, int]:
    """The layout an accelerate config's parallelism_config hands the processes through the environment (1: unset)."""
    sizes = {"replicate": "DP_REPLICATE_SIZE", "shard": "DP_SHARD_SIZE", "tp": "TP_SIZE", "cp": "CP_SIZE"}
    return {key: int(os.environ.get(f"PARALLELISM_CONFIG_{name}") or 1) for key, name in sizes.items()}


TORCH_DTYPES = ("auto", "float32", "bfloat16")  # RunArguments.torch_dtype


@dataclass
class RunArguments:
    """What to train on: the model and the data. Parsed beside DiLoCoConfig by the CLI (YAML keys and flags)."""

    task: str = field(
        default="causal-lm",
        metadata={"help": "What the model learns: 'causal-lm' (next token), 'seq2seq' (an encoder-decoder, trained by "
                          "Seq2SeqTrainer), 'masked-lm' (15% of the tokens masked), 'sequence-classification' or "
                          "'image-classification' (accuracy is reported). Each has built-in data ('builtin') and a "
                          "preset; a model saved for another task is refused.", "choices": list(TASKS)},
    )
    model_name_or_path: str = field(
        default="tiny-llama",
        metadata={"help": "A preset built from a config (tiny-llama ≈ 1M params, llama-20m ≈ 20M, llama-150m ≈ 155M "
                          "(the paper's smallest), llama-7b ≈ 6.5B (Llama-2-7B's layers); tiny-t5 for seq2seq, "
                          "tiny-bert for masked-lm and sequence-classification, tiny-vit for image-classification), a "
                          "local model directory, or a Hub model id."},
    )
    torch_dtype: str = field(
        default="auto",
        metadata={"help": "The dtype the model's weights are loaded in (and trained in): 'auto' (a checkpoint's own, "
                          "float32 for a preset), 'float32', or 'bfloat16' (half the memory of the weights, their "
                          "gradients and AdamW's moments; usually with bf16: true). θ_global and the outer "
                          "optimizer's state are float32 whatever it is.", "choices": list(TORCH_DTYPES)},
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The tokenizer, when not the model's own (a preset's is the byte tokenizer): a local "
                          "folder, a Hub id, or 'byte' for the built-in byte tokenizer. A tokenizer that cannot be "
                          "loaded, is empty or has more ids than the model embeds is refused."},
    )
    dataset_name: str = field(
        default="builtin",
        metadata={"help": "'builtin' (the stdlib's pydoc topics, no download), a local text/json/jsonl/csv/parquet "
                          "file or folder, or a Hub dataset id."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name, if any."})
    text_column: str = field(default="text", metadata={"help": "Column holding the raw text."})
    block_size: int = field(default=256, metadata={"help": "Tokens per training block (sequence length)."})
    eval_fraction: float = field(
        default=0.05, metadata={"help": "Fraction of blocks held out for evaluation (the last ones)."}
    )
    seed_model: int = field(default=0, metadata={"help": "Seed for the initial weights of a preset model."})
    streaming: bool = field(
        default=False,
        metadata={"help": "Stream the dataset instead of loading it whole (needs max_steps); each replica reads "
                          "its own part, and the first eval_blocks blocks are held out."},
    )
    eval_blocks: int = field(default=64, metadata={"help": "Blocks held out for evaluation when streaming (the "
                                                           "stream's first documents); with trainer sft or dpo, "
                                                           "rows."})
    trainer: str = field(
        default="diloco",
        metadata={"help": "'diloco' (DiLoCoTrainer on token blocks), 'sft' or 'dpo' (TRL's SFTTrainer or "
                          "DPOTrainer with DiLoCo, on conversations or preference pairs; pip install "
                          "'hf-diloco[trl]'; their fields, such as max_length, join the recipe's), or 'ddp' for the "
                          "ordinary data-parallel Trainer baseline (gradients all-reduced every step; the DiLoCo "
                          "fields are ignored; on a recipe that says sft or dpo, --trainer ddp keeps TRL's trainer "
                          "and its fields).", "choices": list(TRAINERS)},
    )
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains the full model, > 0 trains PEFT LoRA "
                                                      "adapters (only they are synced and counted)."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: str = field(
        default="auto", metadata={"help": "Comma-separated module names that get LoRA adapters; 'auto': chosen for "
                                          "the architecture (PEFT's choice: the attention's query and value "
                                          "projections, q_proj,v_proj on Llama, c_attn on GPT-2)."}
    )
    merge_lora: bool = field(
        default=False,
        metadata={"help": "After training, also save the model with the adapters merged in, to <output_dir>/merged."},
    )
    verbose: bool = field(
        default=False,
        metadata={"help": "Show on the console what Trainer shows on every process: each one's progress bars, its "
                          "dicts of logs and its warnings. By default the run's main process draws one progress bar "
                          "and prints one [diloco] line per sync; the logs go to trainer_log.jsonl and report_to."},
    )
    dry_run: bool = field(
        default=False,
        metadata={"help": "Check the arguments, the model (built from its config, with no weights) and a local "
                          "dataset (its first row), print the plan (sizes, bytes per round) and exit without "
                          "loading data or training."},
    )

    def __post_init__(self):
        checks.check(self, ["block_size", "eval_fraction"])
        if self.trainer not in TRAINERS:
            raise ConfigError(f"trainer must be one of {', '.join(map(repr, TRAINERS))}, got {self.trainer!r}.")
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}.")
        if self.task != "causal-lm" and self.trainer in ("sft", "dpo"):
            raise ConfigError(f"trainer {self.trainer} trains a causal language model on conversations; task "
                              f"{self.task} trains with trainer diloco (or ddp, the baseline).")
        if self.task != "causal-lm" and self.streaming:
            raise ConfigError(f"streaming reads a corpus of text for causal-lm; task {self.task} reads its rows "
                              f"whole (drop streaming).")
        checks.check(self, ["lora_r"])
        if self.torch_dtype not in TORCH_DTYPES:
            raise ConfigError(f"torch_dtype must be one of {', '.join(TORCH_DTYPES)}, got {self.torch_dtype!r}.")
