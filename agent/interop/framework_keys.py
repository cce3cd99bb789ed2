"""Where ckpt's framework integrations keep their state in a bundle, named once: the
integrations (``ckpt.integrations``) save and restore there, and ``import`` fills the same
places from a framework's own checkpoint."""

from __future__ import annotations

# The TrainerState fields the Hugging Face integration carries: where the run is and what
# it logged. The rest (max_steps, logging_steps, batch size...) comes from the
# TrainingArguments of each attempt.
TRAINER_STATE_FIELDS = (
    "epoch",
    "global_step",
    "num_input_tokens_seen",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)

LIGHTNING_FIT_LOOP = "lightning_fit_loop"  # the fit loop's progress in the counters' extras
