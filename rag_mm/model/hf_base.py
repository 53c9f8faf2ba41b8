"""What the two Hugging Face readers share (``hf_reader``: a causal LM over an open_clip tower;
``hf_vlm``: a whole vision-language model): token embeddings, the logits as the model's own forward
computes them, the forward over ``ReaderBase``'s layout, and the init of the reader's own parts."""

from __future__ import annotations

import torch
import torch.nn as nn

from rag_mm.model.layout import ReaderBase, ReaderOutput


class HFReaderBase(ReaderBase):
    """A subclass sets ``softcap``, ``type_emb``, ``rank_emb`` and ``copy`` and names its
    transformers model (``hf_model``) and that model's decoder without the head (``decoder``)."""

    softcap: float | None  # Gemma 2 caps its logits after the head (config.final_logit_softcapping)

    @property
    def hf_model(self) -> nn.Module:
        raise NotImplementedError

    @property
    def decoder(self) -> nn.Module:
        raise NotImplementedError

    def init_own_weights(self, extra: list[nn.Module] = ()) -> None:
        """Initialise what the pretrained model does not bring: retrieval ranks and token types
        (zero: the model's own forward is unchanged at the start), the copy head and ``extra``
        (normal at the model's initializer range)."""
        if self.rank_emb.weight.is_meta:
            return
        nn.init.zeros_(self.rank_emb.weight)
        nn.init.zeros_(self.type_emb.weight)
        std = getattr(self.hf_model.config.get_text_config(), "initializer_range", 0.02)
        for part in [*extra, *([self.copy] if self.copy is not None else [])]:
            for m in part.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, 0.0, std)
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf_model.get_input_embeddings()(ids)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """(M, D) final hidden states -> (M, V) logits, as the model's own forward computes them."""
        logits = self.hf_model.get_output_embeddings()(h)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(
        self,
        image,
        q_ids,
        q_len,
        a_ids,
        a_len,
        doc_image=None,
        doc_ids=None,
        doc_len=None,
        doc_prior=None,
    ) -> ReaderOutput:
        """As ``Reader.forward``: image (B,3,H,W); q_ids (B,Lq); a_ids (B,La) ending in EOT;
        doc_* (B,k,...) or None; doc_prior (B,k) log retrieval probabilities (copy head) or None."""
        a = self.assemble(image, q_ids, q_len, a_ids, a_len, doc_image, doc_ids, doc_len)
        # padding (-1) takes type 0: it is attended by nothing
        x = a.x + self.type_emb(a.typ.clamp_min(0))
        out = self.decoder(
            inputs_embeds=x, position_ids=a.pos, seg_offsets=a.seg_offsets, use_cache=False
        )
        return self.read_out(out.last_hidden_state, a, self.lm_head, doc_prior)
