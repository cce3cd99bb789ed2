from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckpt.core.contract import Manifest
from service.names import PRINTABLE, Hostname, Id, Label, Rank, RunName, Step, Verdict

Count = Annotated[int, Field(ge=1, le=1_000_000, strict=True)]
# How an attempt says it ended (an EndReason); "lost" is the service's verdict, never reported.
ReportedEnd = Literal["finished", "preempted", "failed"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunCreate(_Request):
    name: RunName
    keep_last: Count | None = None
    keep_every: Count | None = None


class RunPatch(_Request):
    """The run's retention policy and dedup group; a field left out is unchanged, ``null``
    clears it."""

    keep_last: Count | None = None
    keep_every: Count | None = None
    dedup_group: Label | None = Field(
        default=None,
        description="admin only: runs of one group may use each other's blobs without "
        "writing them; null: the run alone",
    )


class BundleRef(BaseModel):
    id: int
    step: int
    status: str


class RunOut(BaseModel):
    name: str
    created_at: datetime
    epoch: int
    head: BundleRef | None
    resumable: BundleRef | None
    keep_last: int | None
    keep_every: int | None
    dedup_group: str | None
    num_bundles: dict[str, int]
    steps_lost_total: int = Field(
        description="the sum of the attempts' steps_lost: steps trained again after endings"
    )
    steps_lost_total_exact: bool = Field(
        default=True,
        description="false when an attempt with a successor was marked lost: its steps lost "
        "are a lower bound, so steps_lost_total is one too (at least that many)",
    )


class RunPage(BaseModel):
    runs: list[RunOut]
    next: str | None = Field(description="pass as ?after= for the next page; null at the end")


class AttemptCreate(_Request):
    pod: Hostname | None = None
    node: Hostname | None = None
    pool: Hostname | None = Field(
        default=None,
        description="the capacity pool it runs on (CKPT_POOL, e.g. aws/us-east-1/p5.48xlarge): "
        "runs on one pool share its history of preemptions",
    )
    resume: Annotated[bool, Field(strict=True)] = Field(
        default=True, description="false: start fresh, even where the run has a head"
    )


class ResumePoint(BaseModel):
    bundle_id: int
    step: int
    micro_step: int
    manifest: Manifest


class AttemptRegistered(BaseModel):
    attempt_id: int
    run: str
    epoch: int
    resume_from: ResumePoint | None
    store: str = Field(
        description="the object store this control plane reads (its URL): the agent must "
        "write its blobs to the same store"
    )


Seconds = Annotated[float, Field(gt=0, le=10**9, allow_inf_nan=False)]
Duration = Annotated[float, Field(ge=0, le=10**9, allow_inf_nan=False)]


class AttemptTime(_Request):
    """Where the attempt's time went so far, as its agent accounts it (cumulative)."""

    restart_seconds: Duration = Field(description="from its process's start until it could train")
    stall_seconds: Duration = Field(description="the loop waiting on saves")
    train_seconds: Duration = Field(description="the rest: training")
    steps_trained: Annotated[int, Field(ge=0, le=10**12, strict=True)]


PartName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
Loss = Annotated[float, Field(allow_inf_nan=False)]


class Fingerprint(_Request):
    """What one rank computed at one training position: the loss it reported and digests of
    its state (opaque to the service). Positions compare as (step, micro_step)."""

    step: Step = Field(description="the step it was taken at, after optimizer.step()")
    micro_step: Step = Field(default=0, description="the gradient-accumulation micro step")
    loss: Loss | None = Field(default=None, description="the loss reported; null: none")
    parts: dict[PartName, Annotated[str, Field(max_length=128, pattern=PRINTABLE)]] = Field(
        max_length=8, description='at most 8 digests, e.g. {"params": "<hex digest>"}'
    )


MAX_FINGERPRINTS = 512


class Heartbeat(_Request):
    step: Step | None = None
    time: AttemptTime | None = None
    interval_seconds: Seconds | None = Field(
        default=None, description="with CKPT_EVERY=auto: the save interval the agent chose"
    )
    waste_seconds_per_hour: (
        Annotated[float, Field(ge=0, le=3600 * 10**6, allow_inf_nan=False)] | None
    ) = Field(
        default=None,
        description="with it: the seconds of each hour it expects to lose there, to saves and "
        "to work redone after preemptions",
    )
    rank: Rank = Field(default=0, description="the rank that beats, in a job of many ranks")
    fingerprints: list[Fingerprint] = Field(
        default=[],
        max_length=MAX_FINGERPRINTS,
        description="the beating rank's fingerprints since its last beat (at most 512): the "
        "service keeps its newest CKPT_FINGERPRINT_RING positions",
    )


class Replay(BaseModel):
    """What the attempt before this one computed at the positions this one replays."""

    from_attempt_id: int | None = Field(description="the attempt they come from; null: none")
    fingerprints: list[Fingerprint] = Field(description="sorted by (step, micro_step)")


class Difference(_Request):
    step: Step
    micro_step: Step
    rank: Rank
    part: Annotated[str, Field(max_length=32, pattern=PRINTABLE)] = Field(
        description='what differed: "loss" or a part\'s name'
    )
    expected: Annotated[str, Field(max_length=128, pattern=PRINTABLE)]
    got: Annotated[str, Field(max_length=128, pattern=PRINTABLE)]


class Verification(_Request):
    """A resumed attempt's verdict on the steps it replayed, compared with what the attempt
    before it computed (reduced over every rank by rank 0)."""

    verdict: Verdict
    mode: Literal["exact", "tolerance"]
    steps_compared: Annotated[int, Field(ge=0, le=10**12, strict=True)] = Field(
        description="replayed positions compared, every rank's counted once"
    )
    from_attempt_id: Id | None = Field(description="the attempt whose fingerprints it compared")
    first_difference: Difference | None = Field(
        default=None, description="the first position that differed: required when diverged"
    )
    max_relative_difference: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        default=None, description="tolerance mode: the largest |a-b|/max(|a|,|b|) seen"
    )
    detail: Annotated[str, Field(max_length=500, pattern=PRINTABLE)] = Field(
        default="", description='a sentence, e.g. "loss matches, params differ"'
    )

    @model_validator(mode="after")
    def _difference_when_diverged(self) -> Verification:
        if (self.verdict == "diverged") != (self.first_difference is not None):
            raise ValueError(
                "first_difference is required when the verdict is diverged, and must be null "
                f"otherwise (verdict {self.verdict!r})"
            )
        return self


Cloud = Literal["aws", "gcp", "azure"]


class AttemptNotice(_Request):
    """A cloud's notice that this capacity is about to be taken away, as the agent read it
    from the instance's metadata service."""

    cloud: Cloud
    kind: Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,39}$")] = Field(
        description="what the cloud announced: aws instance-action or rebalance, gcp "
        "preempted or maintenance, azure preempt (or another scheduled event, lowercased)"
    )
    detail: Annotated[str, Field(max_length=200, pattern=PRINTABLE)] | None = Field(
        default=None, description="the notice in the cloud's words, e.g. 'terminate at ...'"
    )
    step: Step | None = None


class AttemptEnd(_Request):
    reason: ReportedEnd
    final_save_committed: Annotated[bool, Field(strict=True)] = False
    step: Step | None = None
    time: AttemptTime | None = None


class AttemptOut(BaseModel):
    id: int
    run: str
    epoch: int
    pod: str | None
    node: str | None
    started_at: datetime
    heartbeat_at: datetime | None
    last_step: int | None
    ended_at: datetime | None
    end_reason: str | None
    final_save_committed: bool | None
    resumed_from_id: int | None
    fenced: bool
    state: str = Field(
        description="running, replaced (fenced before it reported an end: a newer attempt "
        "registered, or a rollback made way for one), or how it ended: preempted, lost, "
        "failed, finished"
    )
    notice_at: datetime | None = Field(
        default=None, description="when the first notice of a coming preemption reached it"
    )
    notice: str | None = Field(
        default=None, description="that notice: cloud, kind and the cloud's words"
    )
    pool: str | None = None
    interval_seconds: float | None = Field(
        default=None, description="the save interval its agent chose (CKPT_EVERY=auto)"
    )
    waste_seconds_per_hour: float | None = Field(
        default=None, description="the seconds of each hour it expected to lose at that interval"
    )
    steps_lost: int | None = Field(
        description="steps this attempt trained past the bundle its successor resumed from; "
        "null while it runs, has no successor, reported no step, or finished"
    )
    steps_lost_exact: bool | None = Field(
        default=None,
        description="true when steps_lost is exact (the attempt reported its end, with its "
        "step); false when it is a lower bound (the attempt was marked lost: it may have "
        "trained past the step its last heartbeat carried); null with steps_lost",
    )
    time: TimeOut | None = Field(
        default=None, description="where its time went, as its agent last reported"
    )
    verification: Verification | None = Field(
        default=None, description="its resume's verdict on the steps it replayed, if reported"
    )


class TimeOut(BaseModel):
    """goodput = (train - redo) / wall, wall = restart + stall + train."""

    wall_seconds: float
    restart_seconds: float
    stall_seconds: float
    train_seconds: float
    redo_seconds: float = Field(description="of train: the steps lost, at the mean step time")
    goodput: float | None


class RunGoodput(BaseModel):
    run: str
    attempts: int = Field(description="those that reported their time")
    time: TimeOut


class HistoryOut(BaseModel):
    name: str | None = Field(default=None, description="the pool's name")
    exposure_seconds: float = Field(description="the attempts' time alive, summed")
    preemptions: int = Field(description="those preempted or lost (failures do not count)")
    mtbf_seconds: float


class PreemptionRate(BaseModel):
    """The run's mean time between preemptions: (exposure + prior) / (preemptions + 1), its
    pool's estimate as the prior (the pool's own: the configured prior)."""

    mtbf_seconds: float
    prior_seconds: float = Field(description="CKPT_MTBF_PRIOR_SECONDS")
    run: HistoryOut
    pool: HistoryOut | None


class RollbackRequest(_Request):
    bundle_id: Id


class RollbackOut(BaseModel):
    run: str
    epoch: int
    from_bundle_id: int | None
    head: BundleRef


class LineageBundle(BaseModel):
    id: int
    step: int
    micro_step: int
    status: str
    attempt_id: int | None
    parent_id: int | None
    pinned: bool
    created_at: datetime
    committed_at: datetime | None
    live: bool  # on the live branch (the head and its ancestors)


class Edge(BaseModel):
    parent: int
    child: int


class ResumeEdge(BaseModel):
    bundle: int
    attempt: int


class RollbackEvent(BaseModel):
    from_bundle_id: int | None
    to_bundle_id: int
    epoch: int
    created_at: datetime


class Lineage(BaseModel):
    """The run's lineage, or a page of it (``limit``): its newest bundles before
    ``before``, oldest first, with what concerns them; ``next_before`` asks for the page
    after (older), null on the last."""

    run: str
    epoch: int
    head_id: int | None
    resumable_id: int | None
    live_branch: list[int]  # the head first, then its ancestors (in the page, on a page)
    attempts: list[AttemptOut]  # on a page: those with a bundle in it or resuming from one
    bundles: list[LineageBundle]
    parent_edges: list[Edge]
    resume_edges: list[ResumeEdge]
    rollbacks: list[RollbackEvent]  # on a page: those to or from a bundle in it
    forks: list[int]
    next_before: int | None = None
