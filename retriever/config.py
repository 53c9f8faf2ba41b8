"""RetrieverConfig: how the retriever is built, trained and kept fresh (the ``retriever/`` Hydra
group)."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("oracle", "none", "learned")
LOSSES = ("contrastive", "pdist", "emdr", "adist")
FUSIONS = ("sum", "image", "text")
VISION_TOWERS = ("vit", "resnet")
PSEUDO_VIEWS = ("jitter", "photo")  # retriever/augment.py VIEW_STYLES
SEARCH_SETTINGS = ("auto", "faiss", "device")  # retriever/exact.py search_on_device
# the sizes that shape the dual encoder's towers (a checkpoint loads only into the same)
TOWER_SIZES = (
    "embed_dim",
    "vision_width",
    "vision_layers",
    "vision_head_width",
    "patch_size",
    "text_width",
    "text_layers",
    "text_heads",
    "context_length",
)


@dataclass
class RetrieverConfig:
    """Which documents the reader sees, and, in learned mode, the dual encoder that picks them."""

    # oracle (gold document) | none (closed book) | learned (dual encoder + faiss)
    mode: str = "oracle"
    top_k: int = 1  # documents per query given to the reader
    # -- dual encoder (open_clip towers) -------------------------------------------------------
    embed_dim: int = 64  # joint embedding size searched by faiss
    # open_clip vision tower: vit (VisionTransformer) | resnet (ModifiedResNet, CLIP RN50's design)
    vision_tower: str = "vit"
    vision_width: int = 64  # ViT width, or resnet base width (stage widths are 4x, 8x, 16x, 32x it)
    vision_layers: int = 2  # ViT depth, or resnet bottleneck blocks in each of its 4 stages
    vision_head_width: int = 32  # open_clip sets heads by head width
    patch_size: int = 8  # 32 px pictures -> 16 patches
    text_width: int = 64  # open_clip text transformer width
    text_layers: int = 1  # text depth; questions and passages are short
    text_heads: int = 2  # text attention heads
    context_length: int = 32  # text tokens incl. start/end markers (CLIP uses 77; ours are short)
    # how image and text embeddings combine: sum (learned weights) | image | text
    fusion: str = "sum"
    shared_towers: bool = False  # one encoder for queries and documents (Contriever/Atlas share)
    # with shared_towers and the resnet tower: its batch norms keep running statistics per side
    # (retriever/side_norm.py), so the memory's pictures are normalised by the memory's statistics
    # and the queries by the queries', not by their mixture, when the two differ in style
    side_norm: bool = False
    checkpoint: str | None = None  # local open_clip state dict to initialise both towers
    # the reader's copy attention weighs each document by its retrieval probability (RAG-token
    # style)
    reader_prior: bool = True
    # share of the training queries whose k documents the reader reads in a random order with
    # that prior made uniform (rag_mm/model/reading_order.py): a reader that always follows the
    # first document is only as good as recall@1; these queries teach it to tell the right one
    # among the k itself. Evaluation reads the retriever's order and prior
    reader_shuffle: float = 0.0
    # -- training --------------------------------------------------------------------------------
    # reader-driven loss: pdist (Atlas default) | emdr | adist | contrastive (only)
    loss: str = "pdist"
    loss_weight: float = 1.0  # lambda: total = reader NLL + lambda * retriever loss
    # steps with the in-batch contrastive warm-up term (-1: always, 0: never)
    contrastive_steps: int = -1
    contrastive_weight: float = 1.0  # weight of the in-batch contrastive term while it is on
    # memory rows (embeddings of the last refresh) added as negatives to every contrastive term (0:
    # none)
    bank_negatives: int = 1024
    # random views of memory pictures added as queries to each contrastive term
    # (retriever/augment.py)
    pseudo_queries: int = 0
    # how those views stray from the memory's picture (retriever/augment.py VIEW_STYLES): jitter
    # (pose and colour; queries are renderings like the memory's) | photo (smaller, turned, on a
    # busy background, blurred; queries are photos of what the memory shows on a plain ground)
    pseudo_view: str = "jitter"
    # share of those views redrawn in a random style (RandConv: stroke, texture, colour), for
    # queries drawn by another hand than the memory's pictures (another vendor's icon, a sketch)
    pseudo_restyle: float = 0.0
    # largest change (std units) of a random per-channel tone curve on the pseudo-queries
    # (retriever/augment.random_tone): each colour of a view moves on its own, for queries whose
    # colours are each redrawn a little off the memory's (a brightness change moves all together)
    pseudo_tone: float = 0.0
    # share of the pseudo-queries saved as a JPEG at quality 30-80 and read back
    # (retriever/augment.random_jpeg): photos reach the query side compressed, their colours at
    # half resolution, which blurs a small emblem more than the views' blur does
    pseudo_jpeg: float = 0.0
    # strength (0-1 the designed range) of a random non-flat, unevenly lit surface under every
    # pseudo-query (retriever/augment.random_surface: one side stretched, a smooth wave, a smooth
    # light): queries of a thing that bends or waves (a flag, a page, a sign on a curved wall), or
    # drawn by another hand with another wave and sheen, which rigid views do not teach
    pseudo_surface: float = 0.0
    # share of the pseudo-queries drawn as look-alike pairs: half of it random documents, the
    # other half each one's nearest other document by the last refresh's embeddings, so that
    # things told apart by a detail (two flags that differ in an emblem) meet in one batch as
    # queries and gold documents, with live gradients on both sides where the bank's rows are
    # stale (topic-aware batches, TAS-B: Hofstaetter et al., SIGIR 2021). 0: every row at random
    pseudo_neighbours: float = 0.0
    # retriever-only contrastive steps before joint training: the reader learns nothing from a
    # random retriever
    warmup_steps: int = 0
    # the warm-up's peak learning rate (the run's AdamW, fresh moments; joint: optim.lr)
    warmup_lr: float = 2e-3
    # the warm-up's rate at its last step as a share of warmup_lr, reached by a cosine from the
    # first step (1: constant). A falling rate lets the tower settle on what the views teach,
    # where a constant one leaves it wherever the last few batches pushed it
    warmup_min_lr_ratio: float = 1.0
    # the share of the warm-up after which its weights are averaged, every step alike, and the
    # average (batch-norm statistics included) replaces the retriever at its end (1: none): a
    # dense average over a constant rate, SWAD's remedy for queries drawn in a style no training
    # picture has (Cha et al., NeurIPS 2021), lands in a flatter basin than any one step's weights
    warmup_average_from: float = 1.0
    # tau of the reader-derived target softmax(-nll / tau) (pdist, adist)
    gold_temperature: float = 0.1
    # freeze the document encoder (no refresh needed), as Atlas' query-side fine-tuning
    query_side_only: bool = False
    # -- index and refresh -----------------------------------------------------------------------
    index_factory: str = "Flat"  # faiss index_factory string ('auto' picks by memory size)
    # where the memory is searched: "device" (exact: one matmul + top-k on the training device,
    # the document store there too, so a step's search and fetch never wait on the host),
    # "faiss" (faiss on the host, any index_factory), "auto" (device when the index is exact,
    # else faiss); retriever/exact.py
    search: str = "auto"
    refresh_every: int = 50  # steps between re-embedding the memory (0 = never)
    refresh_background: bool = False  # rebuild in a background thread while training goes on
    # over-retrieve then rerank (Atlas): the index's top ``rerank`` candidates are re-embedded by
    # the document tower as it is now and re-sorted, so the top-k the reader reads is not the
    # stale index's between refreshes; costs ``rerank`` document encodings a query. 0: the index's
    # order
    rerank: int = 0
    encode_batch_size: int = 256  # documents per forward pass when (re-)embedding the memory
    # score cos(q - mean_q, d - mean_d): each refresh takes the mean embedding of the documents
    # and of a fixed sample of training queries (retriever/memory.py), so the offset between
    # queries of another kind than the memory's pictures (photos, another artist's drawing) and
    # the documents stops compressing every score
    centre: bool = False
    eval_examples: int = 16  # retrieved examples saved to retrieved_examples.json per evaluation


def validate(cfg: RetrieverConfig) -> list[str]:
    """Problems with a RetrieverConfig (or a DictConfig of one); empty when fine."""
    e = []
    if cfg.mode not in MODES:
        e.append(f"retriever.mode must be one of {MODES} (got {cfg.mode!r})")
    if cfg.loss not in LOSSES:
        e.append(f"retriever.loss must be one of {LOSSES} (got {cfg.loss!r})")
    if cfg.vision_tower not in VISION_TOWERS:
        e.append(
            f"retriever.vision_tower must be one of {VISION_TOWERS} (got {cfg.vision_tower!r})"
        )
    if not 0.0 <= cfg.pseudo_restyle <= 1.0:
        e.append(f"retriever.pseudo_restyle is a share, in [0, 1] (got {cfg.pseudo_restyle})")
    if not 0.0 <= cfg.pseudo_neighbours <= 1.0:
        e.append(f"retriever.pseudo_neighbours is a share, in [0, 1] (got {cfg.pseudo_neighbours})")
    if not 0.0 <= cfg.pseudo_jpeg <= 1.0:
        e.append(f"retriever.pseudo_jpeg is a share, in [0, 1] (got {cfg.pseudo_jpeg})")
    if not 0.0 <= cfg.reader_shuffle <= 1.0:
        e.append(f"retriever.reader_shuffle is a share, in [0, 1] (got {cfg.reader_shuffle})")
    if cfg.pseudo_surface < 0:
        e.append(f"retriever.pseudo_surface must be >= 0 (got {cfg.pseudo_surface})")
    if cfg.pseudo_tone < 0:
        e.append(f"retriever.pseudo_tone must be >= 0 (got {cfg.pseudo_tone})")
    if cfg.search not in SEARCH_SETTINGS:
        e.append(f"retriever.search must be one of {SEARCH_SETTINGS} (got {cfg.search!r})")
    if cfg.pseudo_view not in PSEUDO_VIEWS:
        e.append(f"retriever.pseudo_view must be one of {PSEUDO_VIEWS} (got {cfg.pseudo_view!r})")
    if cfg.fusion not in FUSIONS:
        e.append(f"retriever.fusion must be one of {FUSIONS} (got {cfg.fusion!r})")
    if cfg.side_norm and not (
        cfg.shared_towers and cfg.vision_tower == "resnet" and cfg.fusion != "text"
    ):
        e.append(
            "retriever.side_norm keeps batch-norm statistics per side of one shared picture "
            "tower: it needs retriever.shared_towers=true, retriever.vision_tower=resnet (the "
            "tower with batch norms) and a fusion that reads the picture (got shared_towers="
            f"{cfg.shared_towers}, vision_tower={cfg.vision_tower!r}, fusion={cfg.fusion!r}); "
            "or set retriever.side_norm=false"
        )
    if cfg.mode == "oracle" and cfg.top_k != 1:
        e.append(f"retriever.top_k must be 1 with retriever.mode=oracle (got {cfg.top_k})")
    if cfg.mode == "learned" and cfg.top_k < 1:
        e.append(f"retriever.top_k must be >= 1 with retriever.mode=learned (got {cfg.top_k})")
    if cfg.top_k < 0:
        e.append(f"retriever.top_k must be >= 0 (got {cfg.top_k})")
    for key in (*TOWER_SIZES, "encode_batch_size"):
        if getattr(cfg, key) <= 0:
            e.append(f"retriever.{key} must be positive (got {getattr(cfg, key)})")
    if cfg.gold_temperature <= 0:
        e.append(f"retriever.gold_temperature must be positive (got {cfg.gold_temperature})")
    for key in ("bank_negatives", "warmup_steps", "pseudo_queries"):
        if getattr(cfg, key) < 0:
            e.append(f"retriever.{key} must be >= 0 (got {getattr(cfg, key)})")
    if cfg.warmup_lr <= 0:
        e.append(f"retriever.warmup_lr must be positive (got {cfg.warmup_lr})")
    if not 0.0 <= cfg.warmup_average_from <= 1.0:
        e.append(
            "retriever.warmup_average_from is a share of the warm-up, in [0, 1] "
            f"(got {cfg.warmup_average_from})"
        )
    if not 0.0 <= cfg.warmup_min_lr_ratio <= 1.0:
        e.append(
            "retriever.warmup_min_lr_ratio is a share of warmup_lr, in [0, 1] "
            f"(got {cfg.warmup_min_lr_ratio})"
        )
    if cfg.refresh_every < 0:
        e.append(f"retriever.refresh_every must be >= 0 (got {cfg.refresh_every})")
    if cfg.text_width % max(cfg.text_heads, 1):
        e.append(
            f"retriever.text_heads ({cfg.text_heads}) must divide retriever.text_width "
            f"({cfg.text_width})"
        )
    return e
