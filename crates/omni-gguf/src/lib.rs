//! GGUF reader: metadata, tensor dequantization (Q4_0, Q4_1, Q8_0, F16, F32), HF-layout conversion.
