"""Model file readers: each maps its format onto one TensorStore of Hugging Face names."""
