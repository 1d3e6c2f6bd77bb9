"""edgetrain: train neural networks on memory-limited edge devices."""
