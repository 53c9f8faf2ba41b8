"""How well does a retriever tower trained from scratch find entities it never saw in a query?

The retriever alone, on a knowledge-VQA data root whose query shards carry their gold ``doc_id``
and a ``heldout`` mark (``scripts/emoji_kvqa.py``, ``scripts/convert.py vqa`` with gold links):
the recipe's tower (``retriever.encoders.DualEncoder``, one shared tower, picture only) trained
contrastively on the training queries plus photo-like views of every memory picture
(``retriever.augment.photo_views``, unseen entities' included), every query scored against the
whole memory embedded afresh each step (the exact softmax the trainer's bank negatives
approximate). Recall@1 / @5 of the validation (or test) queries against their gold document,
seen and unseen entities apart, every ``--eval-every`` steps.

    python scripts/bench/retriever_unseen.py data/emoji_kvqa --steps 900 --flip 0.5 --jitter

Beside them, the memory's own pictures of the unseen entities made photo-like (``own_views``):
what the photo transform alone costs, without another vendor's drawing; and ``query_keys``: the
training queries' pictures as further keys of their gold documents (a document scored by the best
of its own row and theirs), which says whether a query sits nearer other things drawn in its own
style than its own document. ``--align`` (an adversary or matched statistics between training
queries and memory views), ``--doc-text`` (documents as picture plus passage), ``--mixstyle``
(feature statistics mixed between the queries), ``--pairs`` (training queries contrasted with
each other, an entity's other pictures the positives) and ``--groups`` (a head naming the gold
passage's group) are domain-generalisation levers measured here, none in the trainer; so is
``--maxsim`` (a stage's grid scored by late interaction, ``retriever.late_interaction``) and
``--domain-bn`` (the memory and the queries each normalised by their own batch statistics at
evaluation, reported beside the running statistics' score; it matches a tower trained without
``--joint``, where each domain has its own call); ``--side-bn`` is its form in the trainer
(``retriever.side_norm``: running statistics kept per side while training, read at evaluation).
``--negatives N`` scores each query against its batch's gold rows and N random others instead
of the whole memory (a large one). ``--joint`` embeds the memory and the queries in one tower
call, so the ResNet's batch statistics span both kinds of picture as they do at evaluation;
``--timm NAME`` swaps the tower for a timm model (random init) through open_clip's
``TimmModel``. Prints one JSON line per evaluation.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
import webdataset as wds
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rag_mm.data.pipeline import image_to_tensor  # noqa: E402
from retriever.augment import VIEW_STYLES, photo_views, random_views  # noqa: E402
from retriever.config import RetrieverConfig  # noqa: E402
from retriever.encoders import DualEncoder  # noqa: E402
from retriever.late_interaction import GridTokens, maxsim, maxsim_pairs  # noqa: E402
from retriever.side_norm import on_side  # noqa: E402

TTA_VIEWS = 3  # pose changes per query in the test-time-augmentation score (each also mirrored)


def load_split(
    root: Path, split: str, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """A split's pictures (N, 3, size, size) normalised, gold doc ids (N,), unseen marks (N,) bool
    and texts (N; a document's passage); the corpus's rows are its documents in doc_id order."""
    shards = sorted(str(p) for p in (root / split).glob("*.tar"))
    if not shards:
        raise FileNotFoundError(f"no shards under {root / split}")
    pics, ids, unseen, texts = [], [], [], []
    for s in wds.WebDataset(shards, shardshuffle=False, empty_check=False):
        meta = json.loads(s["json"])
        pics.append(image_to_tensor(Image.open(io.BytesIO(s["png"])).convert("RGB"), size))
        ids.append(int(meta["doc_id"]))
        unseen.append(bool(meta.get("heldout", False)))
        texts.append(s["txt"].decode() if "txt" in s else "")
    order = np.argsort(ids) if split == "corpus" else np.arange(len(ids))
    pics, ids, unseen = torch.stack(pics)[order], torch.tensor(ids)[order], torch.tensor(unseen)
    return pics, ids, unseen[order], [texts[r] for r in order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="data root with corpus/, train/ and --split/ shards")
    ap.add_argument("--split", default="val")
    ap.add_argument("--image-size", type=int, default=48)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--eval-every", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="training queries a step")
    ap.add_argument(
        "--pseudo", type=int, default=64, help="photo-like views of memory pictures a step"
    )
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument(
        "--width", type=int, default=16, help="retriever.vision_width (the kvqa recipe's)"
    )
    ap.add_argument("--layers", type=int, default=1, help="retriever.vision_layers")
    ap.add_argument("--flip", type=float, default=0.0, help="share of queries mirrored left-right")
    ap.add_argument(
        "--jitter", action="store_true", help="a small random pose / colour change on every query"
    )
    ap.add_argument(
        "--redraw",
        type=float,
        default=0.0,
        help=(
            "a smooth random warp of this amplitude and a colour mix on the memory views "
            "(another artist's drawing)"
        ),
    )
    ap.add_argument(
        "--randconv",
        type=float,
        default=0.0,
        help=(
            "share of query pictures (training queries and memory views) passed through a random "
            "convolution, RandConv's style change (Xu et al., ICLR 2021)"
        ),
    )
    ap.add_argument(
        "--randconv-on",
        choices=("all", "pseudo", "train"),
        default="all",
        help="which query pictures --randconv restyles: all, memory views, training queries",
    )
    ap.add_argument(
        "--joint", action="store_true", help="memory and queries through the tower in one call"
    )
    ap.add_argument(
        "--domain-bn",
        action="store_true",
        help=(
            "also score with each domain normalised by its own batch statistics at evaluation "
            "(AdaBN, Li et al. 2016): the memory's pictures in one call, the queries in theirs; "
            "train without --joint for it"
        ),
    )
    ap.add_argument(
        "--side-bn",
        action="store_true",
        help=(
            "retriever.side_norm: the tower's batch norms keep running statistics per side, the "
            "memory's pictures on the document side and the queries on the query side, in "
            "training and evaluation alike (not with --joint)"
        ),
    )
    ap.add_argument(
        "--negatives",
        type=int,
        default=0,
        help="memory rows scored a step besides the gold ones (0: the whole memory)",
    )
    ap.add_argument("--timm", default="", help="a timm model name for the tower (random init)")
    ap.add_argument(
        "--pretrain",
        type=Path,
        default=None,
        help="another data root (other entities) whose memory and training queries train the "
        "tower for --pretrain-steps first",
    )
    ap.add_argument("--pretrain-steps", type=int, default=0)
    ap.add_argument(
        "--centred-loss",
        action="store_true",
        help="train on cos(q - mean_q, d - mean_d), the means over the step's queries and memory "
        "rows: the score a centred index (retriever.centre) searches with",
    )
    ap.add_argument(
        "--align",
        choices=("none", "dann", "coral"),
        default="none",
        help="pull the training queries' embeddings (other vendors' drawings, photo-like) and the "
        "memory views' (the memory's drawing, photo-like) into one distribution: an adversary "
        "behind a gradient reversal (dann) or their means and covariances matched (coral)",
    )
    ap.add_argument("--align-weight", type=float, default=0.1)
    ap.add_argument(
        "--doc-text",
        action="store_true",
        help="documents embedded as their picture plus their passage (a learned weighted sum, "
        "the text tower shared), queries as their picture alone",
    )
    ap.add_argument(
        "--mixstyle",
        type=float,
        default=0.0,
        help="probability a step mixes the channel statistics (style) of each picture's "
        "features after the tower's first two stages with another picture's (MixStyle, Zhou et "
        "al., ICLR 2021)",
    )
    ap.add_argument(
        "--pairs",
        type=float,
        default=0.0,
        help="weight of a query-to-query term: the step's training queries come in pairs of one "
        "entity (two other pictures of it), each pair's other the positive and the rest of the "
        "step's queries, mostly other entities in the same styles, the negatives",
    )
    ap.add_argument(
        "--groups",
        type=float,
        default=0.0,
        help="weight of a head on the query embedding that names the gold passage's 'group:' "
        "(an attribute seen and unseen entities share); evaluation adds its log-probability of "
        "each document's group, times 0.5 / 1 / 2, to the scaled cosine",
    )
    ap.add_argument(
        "--maxsim",
        default="",
        help="a tower stage (layer1..layer4) whose feature map is kept as a grid of token vectors "
        "and trained with late interaction (retriever.late_interaction: ColBERT's MaxSim) beside "
        "the pooled embedding; evaluation adds MaxSim over the whole memory and the pooled "
        "top --rerank-k reranked by it",
    )
    ap.add_argument("--maxsim-weight", type=float, default=1.0)
    ap.add_argument(
        "--maxsim-over",
        choices=("top", "all"),
        default="top",
        help="MaxSim's training negatives: the pooled score's top --rerank-k (what it reranks) or "
        "every memory row the step scores",
    )
    ap.add_argument("--rerank-k", type=int, default=16)
    ap.add_argument(
        "--csls-k",
        type=int,
        default=10,
        help=(
            "neighbourhood of the CSLS score (Lample et al., ICLR 2018): 2 cos(q, d) minus the "
            "mean cosine of d to its k nearest training queries of other entities"
        ),
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ibn",
        choices=("none", "a", "b"),
        default="none",
        help=(
            "instance normalisation beside the batch norms, to take a picture's style out of the "
            "tower's early features (IBN-Net, Pan et al., ECCV 2018): 'a' normalises half the "
            "channels of each first-three-stage block's first norm per picture; 'b' does that in "
            "the stem's first norm and normalises the outputs of the first two stages per picture"
        ),
    )
    ap.add_argument(
        "--save-scores",
        type=Path,
        help=(
            "write the last evaluation's cosines of every val query against the memory, with the "
            "gold rows and the unseen marks, to this .pt file, and each earlier evaluation's to "
            "STEM_stepN.pt beside it (scripts/bench/retriever_ensemble.py scores several towers "
            "together)"
        ),
    )
    a = ap.parse_args()
    if a.side_bn and a.joint:
        ap.error("--side-bn embeds the memory and the queries in calls of their own: not --joint")
    torch.manual_seed(a.seed)
    try:
        corpus, doc_ids, _, passages = load_split(a.root, "corpus", a.image_size)
        tx, ty, _, _ = load_split(a.root, "train", a.image_size)
        vx, vy, vh, _ = load_split(a.root, a.split, a.image_size)
    except (OSError, KeyError, ValueError) as exc:
        raise SystemExit(f"retriever_unseen: cannot read {a.root}: {exc}") from None
    # gold doc ids -> memory rows (the corpus's rows are sorted by doc id; ids need not be 0..N-1)
    row = {int(d): r for r, d in enumerate(doc_ids)}
    try:
        ty, vy = (torch.tensor([row[int(d)] for d in y]) for y in (ty, vy))
    except KeyError as exc:
        raise SystemExit(
            f"retriever_unseen: a query's gold doc_id {exc} is not in {a.root / 'corpus'}"
        ) from None
    unseen_rows = vy[vh].unique()  # memory rows of the entities no training query shows
    cfg = RetrieverConfig(
        mode="learned",
        vision_tower="resnet",
        vision_width=a.width,
        vision_layers=a.layers,
        fusion="sum" if a.doc_text else "image",
        shared_towers=True,
        side_norm=a.side_bn,
        context_length=64,
    )
    model = DualEncoder(cfg, a.image_size)
    if a.timm:
        from open_clip.timm_model import TimmModel

        model.query.clip.visual = TimmModel(
            a.timm, cfg.embed_dim, image_size=a.image_size, pool="avg", proj="linear"
        )

    grid = None
    if a.maxsim:
        stage = getattr(model.query.clip.visual, a.maxsim)
        channels: list[int] = []  # the stage's width, from one picture in evaluation mode
        probe = stage.register_forward_hook(lambda m, i, out: channels.append(out.shape[1]))
        with torch.no_grad():
            model.eval()
            model.query(corpus[:1], None)
            model.train()
        probe.remove()
        grid = GridTokens(stage, channels[0])

    def mixstyle(module, inputs, out):
        """out (N, C, H, W) -> each sample's features re-normalised to a mix of its own and a
        random other sample's channel mean and spread (Beta(0.1, 0.1) weights)"""
        if not module.training or torch.rand(()) >= a.mixstyle:
            return out
        q0 = mix_from[0]  # the queries' first row: the memory rows keep their own style
        head, out = out[:q0], out[q0:]
        mu = out.mean((2, 3), keepdim=True)
        sig = (out.var((2, 3), keepdim=True) + 1e-6).sqrt()
        mu, sig = mu.detach(), sig.detach()
        lam = torch.distributions.Beta(0.1, 0.1).sample((len(out), 1, 1, 1))
        perm = torch.randperm(len(out))
        mu2, sig2 = lam * mu + (1 - lam) * mu[perm], lam * sig + (1 - lam) * sig[perm]
        return torch.cat([head, (out - mu) / sig * sig2 + mu2])

    class HalfInstance(torch.nn.Module):
        """IBN-Net's norm: the first half of the channels normalised per picture (instance norm
        with its own affine), the rest by the wrapped batch norm (its side kept, --side-bn)."""

        def __init__(self, bn: torch.nn.Module):
            super().__init__()
            self.half = bn.num_features // 2
            self.inorm = torch.nn.InstanceNorm2d(self.half, affine=True)
            self.bn = bn

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, C, H, W)
            return torch.cat([self.inorm(x[:, : self.half]), self.bn(x)[:, self.half :]], 1)

    visual = model.query.clip.visual
    if a.ibn == "a":
        for stage in (visual.layer1, visual.layer2, visual.layer3):
            for block in stage:
                block.bn1 = HalfInstance(block.bn1)
    elif a.ibn == "b":
        visual.bn1 = HalfInstance(visual.bn1)
        for stage in (visual.layer1, visual.layer2):
            inorm = torch.nn.InstanceNorm2d(stage[-1].bn3.num_features, affine=True)
            stage.add_module("ibn_out", inorm)  # Sequential: applied after the stage's blocks

    mix_from = [0]
    if a.mixstyle > 0:
        for stage in (model.query.clip.visual.layer1, model.query.clip.visual.layer2):
            stage.register_forward_hook(mixstyle)

    # the adversary of --align dann: says from an embedding whether it is a training query's
    disc = torch.nn.Sequential(
        torch.nn.Linear(cfg.embed_dim, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)
    )
    params = list(model.parameters()) + (list(disc.parameters()) if a.align == "dann" else [])
    params += list(grid.parameters()) if grid is not None else []
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01)

    class Reverse(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return -a.align_weight * g

    def align_loss(q_train: torch.Tensor, q_pseudo: torch.Tensor) -> torch.Tensor:
        if a.align == "dann":
            logits = disc(Reverse.apply(torch.cat([q_train, q_pseudo]))).squeeze(1)
            target = torch.cat([torch.ones(len(q_train)), torch.zeros(len(q_pseudo))])
            w = torch.cat(
                [
                    torch.full((len(q_train),), 0.5 / len(q_train)),
                    torch.full((len(q_pseudo),), 0.5 / len(q_pseudo)),
                ]
            )
            return (F.binary_cross_entropy_with_logits(logits, target, reduction="none") * w).sum()
        d = q_train.shape[1]
        mean = (q_train.mean(0) - q_pseudo.mean(0)).pow(2).sum()
        cov = (torch.cov(q_train.T) - torch.cov(q_pseudo.T)).pow(2).sum() / (4 * d)
        return a.align_weight * (mean + cov)

    def embed(x: torch.Tensor) -> torch.Tensor:
        if a.doc_text:  # the query side reads the picture alone
            return F.normalize(model.query.clip.encode_image(x), dim=-1)
        return model.query(x, None)  # picture-only fusion: the text input is unused

    # the passages' tokens in memory-row order (--doc-text)
    tokens = open_clip.tokenize(passages, context_length=64)
    ALL = torch.arange(len(corpus))
    # each document's "group:" (--groups)
    names = [re.search(r"group: ([^.]*)\.", t) for t in passages]
    vocab = sorted({m.group(1) for m in names if m})
    doc_group = torch.tensor([vocab.index(m.group(1)) if m else 0 for m in names])  # (N_docs,)
    group_head = torch.nn.Linear(cfg.embed_dim, max(1, len(vocab)))
    if a.groups > 0:
        opt.add_param_group({"params": list(group_head.parameters())})

    def embed_docs(rows: torch.Tensor, img: torch.Tensor | None = None) -> torch.Tensor:
        """memory rows (n,) -> (n, E); ``img`` their pictures' embeddings when already taken"""
        if img is None:
            with on_side(model.query, "doc"):  # a no-op without --side-bn
                img = embed(corpus[rows])
        if not a.doc_text:
            return img
        txt = F.normalize(model.query.clip.encode_text(tokens[rows]), dim=-1)
        return F.normalize(model.query.mix[0] * img + model.query.mix[1] * txt, dim=-1)

    def views(x: torch.Tensor) -> torch.Tensor:
        if a.flip > 0:
            x = torch.where((torch.rand(len(x)) < a.flip)[:, None, None, None], x.flip(-1), x)
        if a.jitter:
            x = random_views(
                x, scale=(0.85, 1.15), max_rotation_deg=10, max_shift=0.08, colour=0.15, noise=0.05
            )
        return x

    def redraw(x: torch.Tensor) -> torch.Tensor:
        """x (N, 3, H, W) -> the same things drawn a little differently: a smooth displacement field
        (a 4 x 4 grid of random offsets, bilinearly upsampled) and a random 3 x 3 colour mix near
        the identity."""
        N, _, H, W = x.shape
        # (N, H, W, 2)
        base = F.affine_grid(torch.eye(2, 3).expand(N, 2, 3), [N, 3, H, W], align_corners=False)
        flow = F.interpolate(
            torch.randn(N, 2, 4, 4) * a.redraw, size=(H, W), mode="bicubic", align_corners=False
        )
        x = F.grid_sample(
            x, base + flow.permute(0, 2, 3, 1), padding_mode="border", align_corners=False
        )
        mix = torch.eye(3) + 0.15 * torch.randn(N, 3, 3)
        return torch.einsum("nij,njhw->nihw", mix, x)

    def randconv(x: torch.Tensor) -> torch.Tensor:
        """x (N, 3, H, W) -> a ``--randconv`` share of them restyled: each through its own random
        k x k convolution (k in 1, 3, 5, 7; He-scaled normal weights), brought back to the
        picture's own per-channel mean and spread, and mixed with it by a random weight. Local
        texture and colour change, the layout of shapes stays."""
        N, C, H, W = x.shape
        k = int(torch.randint(0, 4, ()).item()) * 2 + 1
        w = torch.randn(N * C, C, k, k) / (C * k * k) ** 0.5
        y = F.conv2d(x.reshape(1, N * C, H, W), w, padding=k // 2, groups=N).view(N, C, H, W)
        mu, sd = x.mean((2, 3), keepdim=True), x.std((2, 3), keepdim=True)
        y = (y - y.mean((2, 3), keepdim=True)) / (y.std((2, 3), keepdim=True) + 1e-6) * sd + mu
        alpha = torch.rand(N, 1, 1, 1)
        y = alpha * x + (1 - alpha) * y
        pick = (torch.rand(N) < a.randconv)[:, None, None, None]
        return torch.where(pick, y, x)

    @torch.no_grad()
    def late_interaction_recall(q_val: torch.Tensor, docs: torch.Tensor) -> dict[str, float]:
        """Recall of MaxSim over the whole memory, of the pooled top --rerank-k reranked by it,
        and of the two scores' sum (the val queries pooled as ``q_val``, the memory as ``docs``)"""
        embed(corpus)
        d_tok = grid.take()  # (N_docs, T, dim)
        q_tok = torch.cat(
            [(embed(vx[i : i + 256]), grid.take())[1] for i in range(0, len(vx), 256)]
        )
        ms, cos = maxsim(q_tok, d_tok), q_val @ docs.T  # (Q, N_docs) each
        top = cos.topk(a.rerank_k, 1).indices  # (Q, k)
        ranked = {
            "maxsim": ms.topk(5, 1).indices,
            "rerank": top.gather(1, ms.gather(1, top).argsort(1, descending=True))[:, :5],
            "sum": (cos + ms).topk(5, 1).indices,
        }
        out = {f"recall@{a.rerank_k}_unseen": (top == vy[:, None]).any(1)[vh].float().mean().item()}
        for name, r in ranked.items():
            h1, h5 = (r[:, 0] == vy).float(), (r == vy[:, None]).any(1).float()
            out[f"recall@1_{name}_unseen"] = h1[vh].mean().item()
            out[f"recall@5_{name}_unseen"] = h5[vh].mean().item()
            out[f"recall@1_{name}_seen"] = h1[~vh].mean().item()
        return out

    @torch.no_grad()
    def domain_bn_recall() -> dict[str, float]:
        """Recall with the tower's batch norms on batch statistics (momentum 0: the running ones
        stay as they are): the memory's 256 pictures one batch, the val queries batches of 256
        of their own, so each domain is normalised by itself and not by the training mixture."""
        bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        kept = [(m.training, m.momentum) for m in bns]
        for m in bns:
            m.train()
            m.momentum = 0.0
        try:
            docs = torch.cat([embed_docs(ALL[i : i + 256]) for i in range(0, len(corpus), 256)])
            q = torch.cat([embed(vx[i : i + 256]) for i in range(0, len(vx), 256)])
        finally:
            for m, (training, momentum) in zip(bns, kept, strict=True):
                m.train(training)
                m.momentum = momentum
        top = (q @ docs.T).topk(5, 1).indices == vy[:, None]  # (Q, 5)
        h1, h5 = top[:, :1].any(1).float(), top.any(1).float()
        return {
            "recall@1_domain_bn_unseen": h1[vh].mean().item(),
            "recall@5_domain_bn_unseen": h5[vh].mean().item(),
            "recall@1_domain_bn_seen": h1[~vh].mean().item(),
            "recall@5_domain_bn_seen": h5[~vh].mean().item(),
        }

    @torch.no_grad()
    def csls_hits(
        q: torch.Tensor, docs: torch.Tensor, bank: torch.Tensor, own_out: bool
    ) -> torch.Tensor:
        """(Q, 5) hits of the CSLS score 2 cos(q, d) - r_d, r_d the mean cosine of document d to
        its --csls-k nearest training queries (``bank`` (N_train, E)): a document near many
        queries (a hub) is marked down. With ``own_out`` a document's own training queries are
        left out of its r_d, so that documents with training queries (the seen entities) and
        without (the unseen) are measured alike. The query's own term is the same for every
        document and does not change its ranking."""
        near = docs @ bank.T  # (N_docs, N_train)
        if own_out:
            near = near.masked_fill(ty[None, :] == torch.arange(len(docs))[:, None], -2.0)
        r_d = near.topk(a.csls_k, 1).values.mean(1)  # (N_docs,)
        return (2 * q @ docs.T - r_d).topk(5, 1).indices == vy[:, None]

    @torch.no_grad()
    def evaluate(step: int, seconds: float) -> dict:
        model.eval()

        def in_chunks(emb, x: torch.Tensor) -> torch.Tensor:  # (N, E), 256 pictures a call
            return torch.cat([emb(x[i : i + 256]) for i in range(0, len(x), 256)])

        def hits5(q: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
            """(Q, 5) whether each val query's top 5 memory rows hold its gold one, the queries
            embedded as ``q`` (Q, E) and the memory as ``docs`` (N_docs, E)"""
            return (q @ docs.T).topk(5, 1).indices == vy[:, None]

        docs, q_val = embed_docs(ALL), in_chunks(embed, vx)

        def both_ways(x: torch.Tensor) -> torch.Tensor:  # a picture and its mirror image, averaged
            return F.normalize(embed(x) + embed(x.flip(-1)), dim=-1)

        hits = hits5(q_val, docs)
        # the centred index's score (retriever.centre): the memory's mean and the mean of the
        # first 512 training queries subtracted before the cosine
        mean_q, mean_d = embed(tx[:512]).mean(0), docs.mean(0)
        bank = in_chunks(embed, tx)  # (N_train, E): the training queries, for CSLS and as keys
        hits_c = hits5(F.normalize(q_val - mean_q, dim=-1), F.normalize(docs - mean_d, dim=-1))
        # vendors draw some things facing the other way: the memory and the queries embedded as
        # themselves plus their mirror images
        # (the memory's passages, with --doc-text, have no mirror image: its rows stay as they are)
        with on_side(model.query, "doc"):
            docs_both = docs if a.doc_text else both_ways(corpus)
        flip_hits = hits5(in_chunks(both_ways, vx), docs_both)
        # test-time augmentation of the query alone: its embedding averaged over itself, its
        # mirror image and TTA_VIEWS small pose changes of each (the training jitter's range, a
        # generator of its own so that the training stream does not move)
        tta_gen = torch.Generator().manual_seed(1234)

        def tta(x: torch.Tensor) -> torch.Tensor:
            e = embed(x) + embed(x.flip(-1))
            for _ in range(TTA_VIEWS):
                v = random_views(
                    x,
                    tta_gen,
                    scale=(0.85, 1.15),
                    max_rotation_deg=10,
                    max_shift=0.08,
                    colour=0.0,
                    noise=0.0,
                )
                e = e + embed(v) + embed(v.flip(-1))
            return F.normalize(e, dim=-1)

        q_tta = in_chunks(tta, vx)
        tta_hits = hits5(q_tta, docs)
        if a.save_scores is not None and step > 0:
            # the last evaluation's at the path given, each earlier one's beside it
            path = a.save_scores
            if step != a.steps:
                path = path.with_name(f"{path.stem}_step{step}{path.suffix}")
            torch.save(
                {
                    "cos": q_val @ docs.T,
                    "cos_tta": q_tta @ docs.T,
                    "gold": vy,
                    # the embeddings themselves, for other scores offline: val queries, memory,
                    # training queries (their gold documents in bank_gold), the centring means
                    "q": q_val,
                    "docs": docs,
                    "bank": bank,
                    "bank_gold": ty,
                    "mean_q": mean_q,
                    "mean_d": mean_d,
                    "unseen": vh,
                    "config": {k: str(v) for k, v in vars(a).items()},
                    "step": step,
                },
                path,
            )
        # the memory's own pictures of the unseen entities made photo-like (fixed views): what the
        # photo transform alone costs, without another vendor's drawing
        own = photo_views(
            corpus[unseen_rows], VIEW_STYLES["photo"], torch.Generator().manual_seed(0)
        )
        own_hit = (embed(own) @ docs.T).topk(5, 1).indices == unseen_rows[:, None]
        # the training queries' pictures as further keys of their gold documents: a document's
        # score is the best of its own row and its training pictures' rows
        keys = torch.cat([docs, bank])  # (N_docs + N_train, E)
        key_doc = torch.cat([torch.arange(len(corpus)), ty])
        s = q_val @ keys.T  # (Q, K)
        best = torch.full((len(s), len(corpus)), -2.0).scatter_reduce(
            1, key_doc.expand(len(s), -1), s, reduce="amax"
        )  # (Q, N_docs)
        qk_hits = best.topk(5, 1).indices == vy[:, None]
        csls = {
            "": csls_hits(q_val, docs, bank, True),
            "_all": csls_hits(q_val, docs, bank, False),
            "_centred": csls_hits(
                F.normalize(q_val - mean_q, dim=-1),
                F.normalize(docs - mean_d, dim=-1),
                F.normalize(bank - mean_q, dim=-1),
                True,
            ),
        }
        grp = {}
        if a.groups > 0:
            logp = group_head(q_val).log_softmax(-1)  # (Q, G)
            right = logp.argmax(-1) == doc_group[vy]
            grp["group_acc_unseen"], grp["group_acc_seen"] = (
                right[vh].float().mean().item(),
                right[~vh].float().mean().item(),
            )
            cos = model.scale() * q_val @ docs.T  # (Q, N_docs)
            for beta in (0.5, 1.0, 2.0):
                top1 = (cos + beta * logp[:, doc_group]).argmax(-1) == vy
                grp[f"recall@1_groups{beta}_unseen"] = top1[vh].float().mean().item()
                grp[f"recall@1_groups{beta}_seen"] = top1[~vh].float().mean().item()
        model.train()
        f1, f5 = flip_hits[:, :1].any(1).float(), flip_hits.any(1).float()
        r1, r5 = hits[:, :1].any(1).float(), hits.any(1).float()
        c1, c5 = hits_c[:, :1].any(1).float(), hits_c.any(1).float()
        out = {
            "step": step,
            "seconds": round(seconds, 1),
            "recall@1": r1.mean().item(),
            "recall@5": r5.mean().item(),
            "recall@1_unseen": r1[vh].mean().item(),
            "recall@5_unseen": r5[vh].mean().item(),
            "recall@1_seen": r1[~vh].mean().item(),
            "recall@5_seen": r5[~vh].mean().item(),
            "recall@1_centred_unseen": c1[vh].mean().item(),
            "recall@5_centred_unseen": c5[vh].mean().item(),
            "recall@1_centred_seen": c1[~vh].mean().item(),
            "recall@1_mirror_averaged_unseen": f1[vh].mean().item(),
            "recall@5_mirror_averaged_unseen": f5[vh].mean().item(),
            "recall@1_mirror_averaged_seen": f1[~vh].mean().item(),
            "recall@1_tta_unseen": tta_hits[vh, :1].any(1).float().mean().item(),
            "recall@5_tta_unseen": tta_hits[vh].any(1).float().mean().item(),
            "recall@1_tta_seen": tta_hits[~vh, :1].any(1).float().mean().item(),
            "recall@1_query_keys_seen": qk_hits[~vh, :1].any(1).float().mean().item(),
            "recall@5_query_keys_seen": qk_hits[~vh].any(1).float().mean().item(),
            "recall@1_query_keys_unseen": qk_hits[vh, :1].any(1).float().mean().item(),
            "recall@5_query_keys_unseen": qk_hits[vh].any(1).float().mean().item(),
            "recall@1_own_views_unseen": own_hit[:, :1].any(1).float().mean().item(),
            "recall@5_own_views_unseen": own_hit.any(1).float().mean().item(),
        }
        for name, h in csls.items():
            out[f"recall@1_csls{name}_unseen"] = h[vh, :1].any(1).float().mean().item()
            out[f"recall@5_csls{name}_unseen"] = h[vh].any(1).float().mean().item()
            out[f"recall@1_csls{name}_seen"] = h[~vh, :1].any(1).float().mean().item()
        out |= grp
        if a.domain_bn:
            out |= domain_bn_recall()
        if grid is not None:
            out |= late_interaction_recall(q_val, docs)
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}

    print(
        json.dumps(
            {
                "config": vars(a) | {"root": str(a.root)},
                "params": sum(p.numel() for p in model.parameters()),
                "threads": torch.get_num_threads(),
            },
            default=str,
        )
    )

    last: dict[str, float] = {}

    def train_step(corpus, tx, ty) -> torch.Tensor:
        i = torch.randint(0, len(tx), (a.batch,))
        if a.pairs > 0:  # (B/2,) queries and (B/2,) others of their entities, interleaved
            half = i[: a.batch // 2]
            same = ty[None, :] == ty[half][:, None]  # (B/2, N)
            same[torch.arange(len(half)), half] = False
            other = torch.multinomial(same.float() + 1e-9, 1).squeeze(1)
            i = torch.stack([half, other], 1).flatten()
        j = torch.randint(0, len(corpus), (a.pseudo,))
        mem = redraw(corpus[j]) if a.redraw > 0 else corpus[j]
        # (B + P, 3, H, W)
        train_q, pseudo_q = views(tx[i]), views(photo_views(mem, VIEW_STYLES["photo"]))
        if a.randconv > 0 and a.randconv_on == "train":
            train_q = randconv(train_q)
        if a.randconv > 0 and a.randconv_on == "pseudo":
            pseudo_q = randconv(pseudo_q)
        q = torch.cat([train_q, pseudo_q])
        if a.randconv > 0 and a.randconv_on == "all":  # one kernel size for the step's queries
            q = randconv(q)
        gold = torch.cat([ty[i], j])  # memory rows
        gold_rows = gold
        # the memory rows scored this step: all of them, or the gold rows plus --negatives others
        rows = torch.arange(len(corpus))
        if 0 < a.negatives < len(corpus):
            rows = torch.cat([gold, torch.randint(0, len(corpus), (a.negatives,))]).unique()
            gold = torch.searchsorted(rows, gold)
        if a.joint:
            mix_from[0] = len(rows)
            e = embed(torch.cat([corpus[rows], q]))
            if grid is not None:
                tok = grid.take()
                d_tok, q_tok = tok[: len(rows)], tok[len(rows) :]
            d_emb, q_emb = embed_docs(rows, e[: len(rows)]), e[len(rows) :]
        else:
            mix_from[0] = len(corpus)  # the memory's own call: no row restyled
            d_emb = embed_docs(rows)
            d_tok = grid.take() if grid is not None else None
            mix_from[0] = 0
            q_emb = embed(q)
            q_tok = grid.take() if grid is not None else None
        if a.centred_loss:
            q_emb = F.normalize(q_emb - q_emb.mean(0), dim=-1)
            d_emb = F.normalize(d_emb - d_emb.mean(0), dim=-1)
        loss = F.cross_entropy(model.scale() * q_emb @ d_emb.T, gold)
        if a.groups > 0:
            g_loss = F.cross_entropy(group_head(q_emb), doc_group[gold_rows])
            last["groups"] = g_loss.item()
            loss = loss + a.groups * g_loss
        if a.pairs > 0:
            t = q_emb[: len(i)]  # (B, E): rows 2p and 2p + 1 show one entity
            sim = model.scale() * t @ t.T
            sim = sim.masked_fill(torch.eye(len(t), dtype=torch.bool), float("-inf"))
            partner = torch.arange(len(t)) ^ 1
            # other rows of the same entity are neither positive nor negative
            sim = sim.masked_fill(
                (ty[i][:, None] == ty[i][None, :])
                & (partner[None, :] != torch.arange(len(t))[:, None]),
                float("-inf"),
            )
            last["pairs"] = (qq := F.cross_entropy(sim, partner)).item()
            loss = loss + a.pairs * qq
        if grid is not None and a.maxsim_over == "all":  # MaxSim against every row scored
            ms_loss = F.cross_entropy(grid.scale() * maxsim(q_tok, d_tok), gold)
        elif grid is not None:  # MaxSim over each query's gold row and the pooled top others
            k = min(a.rerank_k, len(rows))
            with torch.no_grad():
                pooled = (q_emb @ d_emb.T).index_put(
                    (torch.arange(len(gold)), gold), -torch.tensor(9.0)
                )
                cand = torch.cat([gold[:, None], pooled.topk(k - 1, 1).indices], 1)  # (Q, k)
            ms = maxsim_pairs(q_tok.repeat_interleave(k, 0), d_tok[cand.flatten()]).view(-1, k)
            ms_loss = F.cross_entropy(grid.scale() * ms, torch.zeros(len(ms), dtype=torch.long))
        if grid is not None:
            last["maxsim"] = ms_loss.item()
            loss = loss + a.maxsim_weight * ms_loss
        if a.align != "none":
            al = align_loss(q_emb[: a.batch], q_emb[a.batch :])
            last["align"] = al.item()
            loss = loss + al
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    if a.pretrain is not None and a.pretrain_steps > 0:
        try:
            p_corpus, p_ids, _, _ = load_split(a.pretrain, "corpus", a.image_size)
            p_tx, p_ty, _, _ = load_split(a.pretrain, "train", a.image_size)
        except (OSError, KeyError, ValueError) as exc:
            raise SystemExit(f"retriever_unseen: cannot read {a.pretrain}: {exc}") from None
        p_row = {int(d): r for r, d in enumerate(p_ids)}
        p_ty = torch.tensor([p_row[int(d)] for d in p_ty])
        t0 = time.perf_counter()
        for step in range(1, a.pretrain_steps + 1):
            loss = train_step(p_corpus, p_tx, p_ty)
            if step % a.eval_every == 0 or step == a.pretrain_steps:
                out = evaluate(-a.pretrain_steps + step, time.perf_counter() - t0)
                print(json.dumps(out | {"pretrain_loss": round(loss.item(), 4)}), flush=True)
    t0, trained = time.perf_counter(), 0.0
    for step in range(1, a.steps + 1):
        loss = train_step(corpus, tx, ty)
        if step % a.eval_every == 0 or step == a.steps:
            trained = time.perf_counter() - t0
            out = evaluate(step, trained) | {"loss": round(loss.item(), 4)}
            print(json.dumps(out | {k: round(v, 4) for k, v in last.items()}), flush=True)
            t0 = time.perf_counter() - trained  # the evaluation is not training time


if __name__ == "__main__":
    main()
