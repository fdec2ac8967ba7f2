"""Optional Triton kernels, each next to a torch reference (tree attention, fused acceptance).

labkit works without them; a later issue fills this package. Nothing here is imported by
labkit unless Triton and a CUDA device are present.
"""
