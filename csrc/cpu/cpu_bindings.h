// Torch-side glue of the CPU kernels, included by csrc/bindings.cpp: turns tensors and the
// option structs (csrc/options.h) into the raw pointer / size / stride argument structs of
// csrc/cpu/cpu_kernels.h, allocates outputs, releases the GIL and calls the kernel table
// selected for the running CPU. One op family per file under csrc/cpu/bindings/ (common.h holds
// the shared helpers); csrc/cuda/cuda_bindings.h is the CUDA twin.
#pragma once
#include "cpu/bindings/attention.h"
#include "cpu/bindings/common.h"
#include "cpu/bindings/ffn.h"
#include "cpu/bindings/linear.h"
#include "cpu/bindings/linear_cross_entropy.h"
#include "cpu/bindings/norm.h"
#include "cpu/bindings/relative_bias.h"
#include "cpu/bindings/rotary.h"
