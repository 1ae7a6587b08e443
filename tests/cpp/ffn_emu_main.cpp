// Runs the CUDA FFN epilogue launchers (csrc/cuda/ffn_epilogue.cu, built for the CPU emulator in
// emu/) on matrices written by tests/test_cuda_backend.py; outputs are pre-filled with NaN.
//
// Usage: ffn_emu DIR. DIR/params.txt: dtype(0 f32, 1 f16, 2 bf16) activation rows cols
// row_stride has_bias row_groups; DIR/{a,b,c}.bin: (rows, row_stride) matrices of dtype,
// DIR/bias.bin: (cols,) of dtype. Computes, all outputs (rows, cols) contiguous:
//   y = act(a + bias)                         -> y.bin
//   dx = b * act'(a + bias), dbias = sum dx   -> dx.bin, dbias.bin (row_groups partial rows)
//   h = act(a) * b                            -> h.bin
//   dgate, dup from dh = c, gate = a, up = b  -> dgate.bin, dup.bin
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "cuda/cuda_kernels.h"

using namespace fastformer;

namespace {

std::vector<unsigned char> read_file(const std::string& path, size_t bytes) {
  std::vector<unsigned char> data(bytes + 16);
  FILE* f = fopen(path.c_str(), "rb");
  if (!f || fread(data.data(), 1, bytes, f) != bytes) {
    fprintf(stderr, "cannot read %zu bytes from %s\n", bytes, path.c_str());
    exit(2);
  }
  fclose(f);
  return data;
}

void write_file(const std::string& path, const void* data, size_t bytes) {
  FILE* f = fopen(path.c_str(), "wb");
  fwrite(data, 1, bytes, f);
  fclose(f);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    fprintf(stderr, "%s failed: %d\n", what, static_cast<int>(err));
    exit(2);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  FILE* pf = fopen((dir + "/params.txt").c_str(), "r");
  int dtype, act, has_bias, row_groups;
  long long rows, cols, stride;
  if (!pf || fscanf(pf, "%d %d %lld %lld %lld %d %d", &dtype, &act, &rows, &cols, &stride,
                    &has_bias, &row_groups) != 7)
    return 2;
  fclose(pf);
  const size_t elt = dtype == 0 ? 4 : 2;
  // std::vector storage is 16-byte aligned (operator new), as cudaMalloc's is (more)
  std::vector<unsigned char> a = read_file(dir + "/a.bin", rows * stride * elt);
  std::vector<unsigned char> b = read_file(dir + "/b.bin", rows * stride * elt);
  std::vector<unsigned char> c = read_file(dir + "/c.bin", rows * stride * elt);
  std::vector<unsigned char> bias =
      has_bias ? read_file(dir + "/bias.bin", cols * elt) : std::vector<unsigned char>();
  const size_t out_bytes = rows * cols * elt;
  std::vector<unsigned char> y(out_bytes, 0xff), dx(out_bytes, 0xff), h(out_bytes, 0xff),
      dgate(out_bytes, 0xff), dup(out_bytes, 0xff), dbias(cols * elt, 0xff);
  std::vector<float> part(row_groups * cols, NAN);

  const DType dt = static_cast<DType>(dtype);
  const Activation a_kind = static_cast<Activation>(act);
  cuda::BiasActFwdParams fp;
  fp.dtype = fp.bias_dtype = dt;
  fp.act = a_kind;
  fp.rows = rows;
  fp.cols = cols;
  fp.x = a.data();
  fp.x_row_stride = stride;
  fp.bias = has_bias ? bias.data() : nullptr;
  fp.y = y.data();
  fp.y_row_stride = cols;
  check(cuda::bias_act_fwd(fp, nullptr), "bias_act_fwd");

  cuda::BiasActBwdParams bp;
  bp.dtype = bp.bias_dtype = dt;
  bp.act = a_kind;
  bp.rows = rows;
  bp.cols = cols;
  bp.dy = b.data();
  bp.dy_row_stride = stride;
  bp.x = a.data();
  bp.x_row_stride = stride;
  bp.bias = fp.bias;
  bp.dx = dx.data();
  bp.dx_row_stride = cols;
  bp.dbias_part = part.data();
  bp.dbias = dbias.data();
  bp.row_groups = row_groups;
  check(cuda::bias_act_bwd(bp, nullptr), "bias_act_bwd");

  cuda::GatedActFwdParams gp;
  gp.dtype = dt;
  gp.act = a_kind;
  gp.rows = rows;
  gp.cols = cols;
  gp.gate = a.data();
  gp.gate_row_stride = stride;
  gp.up = b.data();
  gp.up_row_stride = stride;
  gp.h = h.data();
  gp.h_row_stride = cols;
  check(cuda::gated_act_fwd(gp, nullptr), "gated_act_fwd");

  cuda::GatedActBwdParams gb;
  gb.dtype = dt;
  gb.act = a_kind;
  gb.rows = rows;
  gb.cols = cols;
  gb.dh = c.data();
  gb.dh_row_stride = stride;
  gb.gate = a.data();
  gb.gate_row_stride = stride;
  gb.up = b.data();
  gb.up_row_stride = stride;
  gb.dgate = dgate.data();
  gb.dgate_row_stride = cols;
  gb.dup = dup.data();
  gb.dup_row_stride = cols;
  check(cuda::gated_act_bwd(gb, nullptr), "gated_act_bwd");

  write_file(dir + "/y.bin", y.data(), out_bytes);
  write_file(dir + "/dx.bin", dx.data(), out_bytes);
  write_file(dir + "/dbias.bin", dbias.data(), cols * elt);
  write_file(dir + "/h.bin", h.data(), out_bytes);
  write_file(dir + "/dgate.bin", dgate.data(), out_bytes);
  write_file(dir + "/dup.bin", dup.data(), out_bytes);
  return 0;
}
