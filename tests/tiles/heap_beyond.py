"""What a tiled step's heap holds beyond its tensors and its kernels' scratch, which the
prediction does not count: autograd's nodes, gloo's own buffers, glibc's chunk headers. Measured
on YOLOv2-16's and ResNet-18's tiles (1x2 grids): 0.2-0.6 MB storing everything, 1.8-2.4 MB
with recomputation."""

HEAP_BEYOND_BYTES = 3 * 2**20
