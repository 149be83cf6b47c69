"""Writes a Llama-3.2-1B-shaped GGUF with random Q4_1 weights for `cargo xtask bench --llama-cpp`.

Usage: make_gguf_1b.py TOKENIZER.gguf OUT.gguf

Shape: hidden 2048, 16 layers, 32 query / 8 key-value heads of 64, SwiGLU 8192, rope base
500000, a tied Q8_0 token embedding; like SmolLM2-135M's GGUF (Q4_1 layers, Q8_0 embedding),
only larger. The vocabulary and tokenizer metadata are copied from TOKENIZER.gguf (SmolLM2's,
49,152 tokens, so the embedding is smaller than Llama 3.2's 128,256: 1.07 B parameters in all).
The weights are seeded normal values (std 0.02; norms 1), quantized by the `gguf` package's own
Q4_1/Q8_0 quantizers, so llama.cpp and mlxcel's lossless import read identical 4-bit weights.
Speed, not text, is what the model is for.
"""

import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 2048, 16, 32, 8, 64, 8192

# Keys describing the architecture or the file itself: written fresh, not copied.
OWN = ("llama.", "general.", "GGUF.")


def main():
    src, out = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name("llama-1b-shape-q4_1")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(LAYERS)
    writer.add_context_length(8192)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = None
    for field in reader.fields.values():
        if field.name.startswith(OWN):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            vocab = len(value)
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    writer.add_vocab_size(vocab)

    rng = np.random.default_rng(1234)

    def add(name, shape, qtype):
        if qtype == Q.F32:
            data = np.ones(shape, dtype=np.float32)
        else:
            data = gguf.quants.quantize(
                rng.normal(0.0, 0.02, size=shape).astype(np.float32), qtype
            )
        writer.add_tensor(name, data, raw_dtype=qtype)

    # numpy shapes are [rows, columns] = [out, in]; GGUF lists them reversed.
    add("token_embd.weight", (vocab, HIDDEN), Q.Q8_0)
    add("output_norm.weight", (HIDDEN,), Q.F32)
    for i in range(LAYERS):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (HIDDEN,), Q.F32)
        add(b + "ffn_norm.weight", (HIDDEN,), Q.F32)
        add(b + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), Q.Q4_1)
        add(b + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_1)
        add(b + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_1)
        add(b + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), Q.Q4_1)
        add(b + "ffn_gate.weight", (FFN, HIDDEN), Q.Q4_1)
        add(b + "ffn_up.weight", (FFN, HIDDEN), Q.Q4_1)
        add(b + "ffn_down.weight", (HIDDEN, FFN), Q.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
