"""Named model shapes and training settings for the shipped default models.

A preset is the whole recipe of one shipped model; ``specdec train lm --preset NAME`` uses it and
every field can be overridden on the command line. The other trainers' settings live here too
(``DrafterTrainConfig``, ``Seq2SeqTrainConfig`` and its ``SEQ2SEQ_PRESETS``, ``Seq2SeqBlockConfig``; their
modules re-export them): ``specdec train``'s flags are built from them, and this module imports no torch, so
``specdec train --help`` and a bad flag answer at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder (what ``transformers.LlamaConfig`` needs)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512  # the context the model is trained on, and its limit


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults are the shipped target's recipe."""

    shape: ModelShape = field(default_factory=lambda: ModelShape(512, 6, 8, 1408))
    teacher: str | None = None  # a trained target to distil from (drafters); None = plain LM loss
    init_from: str | None = None  # start from these weights (e.g. a shipped model) instead of random ones
    outputs: str | None = None  # a `specdec train outputs` file (the target's continuations) mixed into the data
    outputs_share: float = 0.5  # share of each batch's windows taken from `outputs` when it is set
    outputs_records: int | None = None  # use only the file's first N records (a file grows when generation resumes)
    kd_weight: float = 0.8  # share of the distillation loss KL(p_teacher || q) when a teacher is set
    seq_len: int = 512  # tokens per training window
    batch_size: int = 8  # windows per step
    lr: float = 1.2e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 100  # linear warm-up
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 1000  # total optimizer steps (the schedule's length; resume keeps it)
    eval_every: int = 100  # steps between validation-loss measurements
    save_every: int = 50  # steps between checkpoints (resume point)
    eval_windows: int = 48  # validation windows (fixed, same for every evaluation)
    bf16: bool = True  # bf16 autocast for forward/backward (weights and optimizer stay fp32)
    seed: int = 0


@dataclass(frozen=True)
class BlockTrainConfig:
    """One block-drafter training run. Defaults are the shipped model's recipe."""

    target: str = "code-target"  # the target distilled from, a folder or shipped
                                 # name (embeddings, tokenizer, hidden states)
    outputs: str = "runs/code-target-outputs.jsonl"  # `specdec train outputs` file; its temperature-0 records
    outputs_records: int | None = None  # read only the file's first N lines (None: all there when the run starts)
    valid: str | None = None  # held-out `specdec train outputs --split validation` file for evaluation
    valid_records: int = 100  # greedy validation records measured at each evaluation
    init_from: str | None = "code-drafter"  # a Llama causal LM of the target's vocabulary whose
                                            # weights start the drafter (its shape replaces the four
                                            # below); None: fresh layers, embeddings from the target
    hidden_size: int = 256  # drafter width
    num_hidden_layers: int = 2  # drafter decoder layers
    num_attention_heads: int = 4  # attention heads per layer
    intermediate_size: int = 704  # MLP width
    max_block_size: int = 25  # largest block k trained (each step draws k uniformly from 1..this)
    draft_vocab_size: int = 2048  # rows of the drafting head: the target's most frequent output tokens (0 = all)
    condition_on_target: bool = False  # add the target's last hidden state to the block positions
    prefix_loss: float = 0.5  # weight of the next-token loss at prefix positions (dense signal for the prefix states)
    hidden_dropout: float = 0.1  # share of blocks trained without the target's hidden state (first rounds)
    block_tokens: int = 128  # block positions per training sequence: ceil(block_tokens / k) blocks of the step's k
    seq_len: int = 256  # longest prefix per sequence (prompts are cropped from the left)
    batch_size: int = 16  # sequences per step
    glancing_start: float = 0.5  # glancing ratio at step 0 (share of wrong positions revealed)
    glancing_end: float = 0.3  # glancing ratio at max_steps (linear in between)
    label_smoothing: float = 0.1  # cross-entropy label smoothing
    lr: float = 2e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 100  # linear warm-up
    weight_decay: float = 0.1  # AdamW weight decay (matrices only)
    grad_clip: float = 1.0  # gradient-norm clip
    max_steps: int = 3000  # optimizer steps
    eval_every: int = 250  # steps between validation measurements (needs `valid`)
    save_every: int = 50  # steps between checkpoints
    bf16: bool = False  # bf16 autocast (weights and optimizer stay fp32); slower on CPUs without bf16 units
    seed: int = 0  # data order, block cuts and glancing choices


PRESETS: dict[str, TrainConfig] = {
    # ~23.5M parameters with the 8192-token vocabulary (tied embeddings).
    "code-target": TrainConfig(),
    # ~1.9M parameters: 12x smaller, distilled from the target.
    "code-drafter": TrainConfig(
        shape=ModelShape(160, 2, 5, 448), teacher="runs/code-target/final", lr=3e-3, max_steps=750
    ),
    # Stage 2 of each shipped model (session 2's continuation): new batches (seed 1), fresh AdamW,
    # a lower peak learning rate and its own warm-up and cosine decay.
    "code-target-s2": TrainConfig(init_from="runs/code-target/final", lr=6e-4, warmup_steps=50, seed=1),
    "code-drafter-s2": TrainConfig(
        shape=ModelShape(160, 2, 5, 448), teacher="runs/code-target-s2/final", init_from="runs/code-drafter/final",
        lr=1.5e-3, warmup_steps=50, seed=1,
    ),
    # Stage 3 (session 3): the same continuation once more, on seed 2's batches, at a lower peak rate
    # (the drafter for 600 steps: in stage 2 its acceptance rose little after step 500).
    "code-target-s3": TrainConfig(init_from="runs/code-target-s2/final", lr=4e-4, warmup_steps=50, seed=2),
    "code-drafter-s3": TrainConfig(
        shape=ModelShape(160, 2, 5, 448), teacher="runs/code-target-s3/final", init_from="runs/code-drafter-s2/final",
        lr=1e-3, warmup_steps=50, seed=2, max_steps=600,
    ),
    # Stage 4 (session 5): the drafter continues on its job's data: half of each batch is the
    # target's own continuations of train-split prompts (`specdec train outputs`, loops left out).
    "code-drafter-s4": TrainConfig(
        shape=ModelShape(160, 2, 5, 448), teacher="runs/code-target-s3/final", init_from="runs/code-drafter-s3/final",
        outputs="runs/code-target-outputs.jsonl", outputs_records=8000, lr=1e-3, warmup_steps=30, seed=3,
        max_steps=400,
    ),
    # Stage 5: the same once more after `specdec train outputs --num-prompts 12000` added 4000 prompts
    # (11999 records: one prompt was too long for the context).
    "code-drafter-s5": TrainConfig(
        shape=ModelShape(160, 2, 5, 448), teacher="runs/code-target-s3/final", init_from="runs/code-drafter-s4/final",
        outputs="runs/code-target-outputs.jsonl", outputs_records=11999, lr=6e-4, warmup_steps=30, seed=4,
        max_steps=400,
    ),
    # seconds-long run for tests and smoke checks
    "tiny": TrainConfig(
        shape=ModelShape(32, 1, 2, 64, 64), seq_len=32, batch_size=4, max_steps=20, eval_every=10,
        save_every=10, eval_windows=4, warmup_steps=2, lr=3e-3,
    ),
}


# ------------------------------------------------- the other trainers' settings (their flags are built from them)


@dataclass(frozen=True)
class DrafterTrainConfig:
    """One drafter run: its shape, its data and its optimizer."""

    target: str = ""  # the target model's folder
    data: str = ""  # a `specdec data outputs` file written with that target
    layers: int = 2  # decoder layers of the drafter
    hidden: int | None = None  # width of a shrunk drafter (a multiple of the target's head count); None = the target's
    init: str = "shrunk"  # shrunk: fresh layers, the target's embeddings;
                          # first-layers: the target's first --layers layers
    steps: int = 300  # optimizer steps
    batch_size: int = 8  # records per step
    lr: float = 1e-3  # peak AdamW learning rate (linear warm-up, cosine decay)
    warmup_steps: int = 20  # linear warm-up
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seq_len: int = 512  # tokens per record trained on (a longer one keeps its last seq_len)
    records: int | None = None  # records of --data trained on (None: all there are when the run starts; kept on resume)
    eval_every: int = 100  # steps between held-out measurements (KL, top-1 agreement)
    save_every: int = 50  # steps between checkpoints (resume point)
    eval_records: int = 64  # held-out records measured each time
    seed: int = 0

    @property
    def max_steps(self) -> int:  # the name the shared optimizer loop and schedule read
        return self.steps


@dataclass(frozen=True)
class FeatureDrafterTrainConfig:
    """One feature drafter run (EAGLE-3, ``specdec.train.feature_drafter``): its data, depth and optimizer."""

    target: str = ""  # the target model's folder
    data: str = ""  # a `specdec data outputs` file written with that target
    feature_layers: str = ""  # the target's 3 decoder layers read, e.g. 1,3,4 ("" = EAGLE-3's low, middle, high)
    layout: str = "proj"  # "proj" (a 2H -> H projection feeds the target's layer) or "eagle3" (EAGLE-3's own layer:
    # what `specdec export --format eagle3` writes for vLLM and SGLang; specdec.drafters.feature_model)
    ttt_steps: int = 4  # drafting steps unrolled by training-time test (>= 1; EAGLE-3 trains >= 3)
    step_decay: float = 0.8  # weight of unrolled step k is step_decay ** k (EAGLE-3's)
    autocast: str = ""  # "bf16": both models' forwards under bf16 autocast (CPUs with avx512_bf16, GPUs); "" = fp32
    init_from: str = ""  # a feature drafter folder (a run's final) whose weights start this run: a new stage
    steps: int = 300  # optimizer steps
    batch_size: int = 8  # records per step
    lr: float = 1e-3  # peak AdamW learning rate (linear warm-up, cosine decay)
    warmup_steps: int = 20  # linear warm-up
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seq_len: int = 256  # tokens per record trained on (a longer one keeps its last seq_len)
    records: int | None = None  # records of --data trained on (None: all there are when the run starts; kept on resume)
    eval_every: int = 50  # steps between held-out measurements (KL and agreement per depth)
    save_every: int = 25  # steps between checkpoints (resume point)
    eval_records: int = 32  # held-out records measured each time
    seed: int = 0

    @property
    def max_steps(self) -> int:  # the name the shared optimizer loop and schedule read
        return self.steps


@dataclass(frozen=True)
class ParallelDrafterTrainConfig:
    """One parallel drafter run (``specdec.train.parallel_drafter``): its data, shape and optimizer."""

    target: str = ""  # the target model's folder
    data: str = ""  # a `specdec data outputs` file written with that target
    feature_layers: str = ""  # the target's 3 decoder layers read, e.g. 1,3,4 ("" = EAGLE-3's low, middle, high)
    block_size: int = 8  # mask slots per block: the most tokens drafted per round
    draft_layers: int = 1  # decoder layers of the target's class (1 or 2)
    steps: int = 300  # optimizer steps
    batch_size: int = 8  # records per step
    lr: float = 1e-3  # peak AdamW learning rate (linear warm-up, cosine decay)
    warmup_steps: int = 20  # linear warm-up
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seq_len: int = 256  # tokens per record trained on (a longer one keeps its last seq_len)
    records: int | None = None  # records of --data trained on (None: all there are when the run starts; kept on resume)
    eval_every: int = 50  # steps between held-out measurements
    save_every: int = 25  # steps between checkpoints (resume point)
    eval_records: int = 32  # held-out records measured each time
    seed: int = 0
    glancing_start: float = 0.0  # glancing (GLAT): share of a block's wrong slots revealed at step 0 (0 and 0: off)
    glancing_end: float = 0.0  # the share at the last step, linear in between (the block drafter's: 0.5 -> 0.3)
    autocast: str = ""  # "bf16": both models' forwards under bf16 autocast (CPUs with avx512_bf16, GPUs); "" = fp32

    @property
    def max_steps(self) -> int:  # the name the shared optimizer loop and schedule read
        return self.steps


@dataclass(frozen=True)
class Seq2SeqShape:
    """A Marian encoder-decoder (what ``transformers.MarianConfig`` needs)."""

    d_model: int
    encoder_layers: int
    decoder_layers: int
    attention_heads: int  # per layer, encoder and decoder alike
    ffn_dim: int  # feed-forward width, encoder and decoder alike
    max_position_embeddings: int = 512  # longest source or translation in tokens (sinusoidal table)


@dataclass(frozen=True)
class Seq2SeqTrainConfig:
    """One encoder-decoder training run. Defaults are the shipped target's recipe."""

    shape: Seq2SeqShape = field(default_factory=lambda: Seq2SeqShape(256, 3, 3, 4, 768))
    data: str = "data/gettext-de"  # a `specdec data gettext` folder (train.jsonl, validation.jsonl)
    tokenizer: str = "runs/translate-tokenizer"  # a `specdec train seq2seq-tokenizer` folder
    translations: str | None = None  # the target's translations of the train sources (distillation);
                                     # None (CLI: `references`) = the reference translations
    init_from: str | None = None  # start from this trained model (a stage-2 run: fresh optimizer and schedule)
    batch_size: int = 64  # sentence pairs per step (batches group pairs of similar length)
    max_tokens: int = 128  # pairs longer than this on either side (eos included) are left out of training
    lr: float = 1e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.05  # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 200  # linear warm-up
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    label_smoothing: float = 0.1
    dropout: float = 0.1  # dropout of the model (attention and activations use it too)
    max_steps: int = 600  # total optimizer steps (the schedule's length; resume keeps it)
    eval_every: int = 250  # steps between validation-loss measurements
    save_every: int = 100  # steps between checkpoints (resume point)
    eval_pairs: int = 1000  # validation pairs in each measurement (the same first ones every time)
    seed: int = 0


SEQ2SEQ_PRESETS: dict[str, Seq2SeqTrainConfig] = {  # `specdec train seq2seq --preset NAME`
    # ~6.8M parameters with the 8000-token vocabulary: 3 + 3 layers of width 256 (600 steps: 0.75 epoch,
    # what one contended CPU thread gave in the time there was).
    "translate-target": Seq2SeqTrainConfig(),
    # Stage 2: the same model continued from stage 1 (new batch order, fresh AdamW, its own warm-up
    # and cosine decay).
    "translate-target-s2": Seq2SeqTrainConfig(init_from="runs/translate-target/final", lr=7e-4, warmup_steps=100,
                                              max_steps=3000, seed=1),
    # ~2.1M parameters: 2 + 2 layers of width 128, on the target's greedy translations.
    "translate-drafter": Seq2SeqTrainConfig(
        shape=Seq2SeqShape(128, 2, 2, 4, 512), translations="runs/translate-target-translations-train.jsonl",
        lr=2e-3, max_steps=600, warmup_steps=100, dropout=0.05,
    ),
    # Stage 2 of the drafter: continued from stage 1 on the target's translations of all the train
    # sources (stage 1 had the first 10,240), a lower peak rate, its own warm-up and cosine decay.
    "translate-drafter-s2": Seq2SeqTrainConfig(
        shape=Seq2SeqShape(128, 2, 2, 4, 512), translations="runs/translate-target-translations-train.jsonl",
        init_from="runs/translate-drafter/final", lr=1e-3, max_steps=1500, warmup_steps=50, dropout=0.05, seed=1,
    ),
    # seconds-long run for tests and smoke checks
    "tiny": Seq2SeqTrainConfig(
        shape=Seq2SeqShape(32, 1, 1, 2, 64, 64), batch_size=8, max_tokens=48, max_steps=20, eval_every=10,
        save_every=10, eval_pairs=16, warmup_steps=2, lr=3e-3, dropout=0.0,
    ),
}


@dataclass(frozen=True)
class Seq2SeqBlockConfig:
    """One encoder-decoder block-drafter training run. Defaults are the shipped model's recipe."""

    target: str = "runs/translate-target-s2/final"  # the target distilled from (its
                                                    # encoder, embeddings, decoder layers)
    data: str = "data/gettext-de"  # the `specdec data gettext` folder the translations were made from
    translations: str = "runs/translate-target-translations-train.jsonl"  # `specdec train translations` of the target
    outputs: str | None = None  # a `specdec data outputs` file of the target's (replaces data and translations)
    decoder_layers: int = 2  # the drafter's decoder layers (the target's first ones to start)
    max_block_size: int = 8  # largest block k trained (each step draws k uniformly from 1..this)
    mask_token_id: int | None = None  # the block's input token (None: the tokenizer's
                                      # unk, which byte-level BPE never emits)
    prefix_loss: float = 0.5  # weight of the next-token loss at prefix positions
    batch_size: int = 64  # rows per step
    max_tokens: int = 128  # pairs longer than this on either side are left out
    lr: float = 7e-4  # peak AdamW learning rate
    min_lr_ratio: float = 0.05  # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 100  # linear warm-up
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    label_smoothing: float = 0.1
    dropout: float = 0.1  # the model's dropout while training
    max_steps: int = 2000  # optimizer steps
    eval_every: int = 250  # steps between held-out measurements
    save_every: int = 100  # steps between checkpoints (resume point)
    eval_pairs: int = 256  # held-out rows measured at each evaluation
    seed: int = 0
