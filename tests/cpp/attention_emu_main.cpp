// Runs the CUDA attention launchers (csrc/cuda/attention_{fwd,bwd}.cu, built for the CPU
// emulator in emu/) on tensors written by tests/test_cuda_backend.py, playing the part of
// csrc/cuda/cuda_bindings.h: it allocates out as (B, Lq, H, D), lse, dq/dk/dv as (B, H, L, D)
// and the workspaces, all pre-filled with NaN so an element a kernel forgets to write shows.
//
// Usage: attention_emu DIR. DIR/params.txt holds, whitespace-separated:
//   dtype(1 f16, 2 bf16) head_dim B H Hkv Lq Lk causal scale has_key_padding window_left
//   window_right softcap   (the window sides -1 for no limit, softcap 0 for off)
//   then for each of q, k, v, dout: FILE OFFSET BATCH_STRIDE HEAD_STRIDE ROW_STRIDE, the tensor
//   being element (b, h, i, d) = DIR/FILE's 16-bit storage at OFFSET + b*BATCH_STRIDE + ...
//   (tensors may share a file: k and v as views of one packed buffer)
// and DIR/kpm.bin the (B, Lk) bool key padding mask. Writes DIR/{out,lse,dq,dk,dv}.bin.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <map>
#include <string>
#include <vector>

#include "cuda/cuda_kernels.h"

using namespace fastformer;

namespace {

std::vector<unsigned char> read_file(const std::string& path) {
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) {
    fprintf(stderr, "cannot open %s\n", path.c_str());
    exit(2);
  }
  std::vector<unsigned char> data;
  unsigned char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) data.insert(data.end(), buf, buf + n);
  fclose(f);
  return data;
}

void write_file(const std::string& path, const void* data, size_t bytes) {
  FILE* f = fopen(path.c_str(), "wb");
  fwrite(data, 1, bytes, f);
  fclose(f);
}

// 16-byte aligned buffer filled with 0xff (NaN) or a file's bytes.
struct Buffer {
  std::vector<unsigned char> bytes;
  explicit Buffer(size_t n) : bytes(n + 16, 0xff) {}
  explicit Buffer(const std::vector<unsigned char>& src) : bytes(src.size() + 16) {
    memcpy(data(), src.data(), src.size());
  }
  void* data() {
    const uintptr_t p = reinterpret_cast<uintptr_t>(bytes.data());
    return reinterpret_cast<void*>((p + 15) / 16 * 16);
  }
  size_t size() const { return bytes.size() - 16; }
};

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    fprintf(stderr, "%s failed: %d\n", what, static_cast<int>(err));
    exit(2);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  FILE* pf = fopen((dir + "/params.txt").c_str(), "r");
  if (!pf) return 2;
  int dtype, head_dim, causal, has_kpm;
  long long B, H, Hkv, Lq, Lk, window_left, window_right;
  float scale, softcap;
  if (fscanf(pf, "%d %d %lld %lld %lld %lld %lld %d %f %d %lld %lld %f", &dtype, &head_dim, &B, &H,
             &Hkv, &Lq, &Lk, &causal, &scale, &has_kpm, &window_left, &window_right,
             &softcap) != 13)
    return 2;
  std::map<std::string, Buffer> files;
  cuda::HeadsIn inputs[4];  // q, k, v, dout
  for (cuda::HeadsIn& t : inputs) {
    char name[64];
    long long offset;
    if (fscanf(pf, "%63s %lld %lld %lld %lld", name, &offset, &t.batch, &t.head, &t.row) != 5)
      return 2;
    auto it = files.find(name);
    if (it == files.end()) it = files.emplace(name, Buffer(read_file(dir + "/" + name))).first;
    t.data = static_cast<const char*>(it->second.data()) + 2 * offset;
  }
  fclose(pf);
  std::vector<unsigned char> kpm =
      has_kpm ? read_file(dir + "/kpm.bin") : std::vector<unsigned char>();

  cuda::AttentionShape shape;
  shape.dtype = static_cast<DType>(dtype);
  shape.head_dim = head_dim;
  shape.batch = B;
  shape.heads = H;
  shape.kv_heads = Hkv;
  shape.len_q = static_cast<int>(Lq);
  shape.len_k = static_cast<int>(Lk);
  shape.scale = scale;
  shape.causal = causal;
  shape.window_left = window_left;
  shape.window_right = window_right;
  shape.softcap = softcap;
  if (has_kpm) {
    shape.key_padding = kpm.data();
    shape.key_padding_batch_stride = Lk;
    shape.key_padding_key_stride = 1;
  }
  const long long D = head_dim;

  // forward: out (B, Lq, H, D) seen as (B, H, Lq, D)
  Buffer out(2 * B * Lq * H * D), lse(4 * B * H * Lq);
  cuda::AttentionFwdParams fp;
  fp.shape = shape;
  fp.q = inputs[0];
  fp.k = inputs[1];
  fp.v = inputs[2];
  fp.out = {out.data(), Lq * H * D, D, H * D};
  fp.lse = static_cast<float*>(lse.data());
  check(cuda::attention_fwd(fp, nullptr), "attention_fwd");

  Buffer dq(2 * B * H * Lq * D), dk(2 * B * Hkv * Lk * D), dv(2 * B * Hkv * Lk * D);
  Buffer dq_accum(4 * B * H * Lq * D), delta(4 * B * H * Lq);
  cuda::AttentionBwdParams bp;
  bp.shape = shape;
  bp.q = fp.q;
  bp.k = fp.k;
  bp.v = fp.v;
  bp.out = {out.data(), Lq * H * D, D, H * D};
  bp.dout = inputs[3];
  bp.lse = fp.lse;
  bp.dq = {dq.data(), H * Lq * D, Lq * D, D};
  bp.dk = {dk.data(), Hkv * Lk * D, Lk * D, D};
  bp.dv = {dv.data(), Hkv * Lk * D, Lk * D, D};
  bp.dq_accum = static_cast<float*>(dq_accum.data());
  bp.delta = static_cast<float*>(delta.data());
  check(cuda::attention_bwd(bp, nullptr), "attention_bwd");

  write_file(dir + "/out.bin", out.data(), out.size());
  write_file(dir + "/lse.bin", lse.data(), lse.size());
  write_file(dir + "/dq.bin", dq.data(), dq.size());
  write_file(dir + "/dk.bin", dk.data(), dk.size());
  write_file(dir + "/dv.bin", dv.data(), dv.size());
  return 0;
}
