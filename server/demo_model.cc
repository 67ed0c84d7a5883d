// attnserve_demo_model: writes a model repository entry with deterministic
// weights, so that a server can start with a model and no large file lives
// in git.
//
//   attnserve_demo_model --out=DIR [--embed_dim=512] [--num_heads=8]
//
// writes DIR/config.pbtxt and DIR/weights.safetensors, the latter named as a
// PyTorch nn.MultiheadAttention state_dict (in_proj_weight, in_proj_bias,
// out_proj.weight, out_proj.bias) with nn.Linear-like scaling.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "core/safetensors.h"

ABSL_FLAG(std::string, out, "", "Model folder to write (created).");
ABSL_FLAG(int, embed_dim, 512, "Embedding width E.");
ABSL_FLAG(int, num_heads, 8, "Attention heads; must divide E.");

namespace attnserve {
namespace {

// Uniform in [-bound, bound) from the raw 32-bit output of a fixed-seed
// Mersenne Twister, whose sequence the C++ standard fixes: the same weights
// on every platform.
Tensor Uniform(Shape shape, float bound, std::mt19937& rng) {
  Tensor t = *Tensor::Allocate(DType::kFloat32, std::move(shape));
  float* v = t.data_as<float>();
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    const float unit = static_cast<float>(rng() >> 8) * (1.0f / 16777216.0f);
    v[i] = (2.0f * unit - 1.0f) * bound;
  }
  return t;
}

int Run() {
  const std::string out = absl::GetFlag(FLAGS_out);
  const int e = absl::GetFlag(FLAGS_embed_dim);
  const int heads = absl::GetFlag(FLAGS_num_heads);
  if (out.empty() || e <= 0 || heads <= 0 || e % heads != 0) {
    std::fprintf(stderr,
                 "attnserve_demo_model: need --out, and --num_heads dividing "
                 "--embed_dim\n");
    return 2;
  }
  std::filesystem::create_directories(out);
  std::mt19937 rng(20261121);
  const float bound = 1.0f / std::sqrt(static_cast<float>(e));
  Tensor in_proj = Uniform({3 * e, e}, bound, rng);
  Tensor in_bias = Uniform({3 * e}, bound, rng);
  Tensor out_proj = Uniform({e, e}, bound, rng);
  Tensor out_bias = Uniform({e}, bound, rng);
  const absl::Status written =
      WriteSafetensors(out + "/weights.safetensors",
                       {{"in_proj_weight", in_proj.view()},
                        {"in_proj_bias", in_bias.view()},
                        {"out_proj.weight", out_proj.view()},
                        {"out_proj.bias", out_bias.view()}},
                       {{"format", "pt"}});
  if (!written.ok()) {
    std::fprintf(stderr, "attnserve_demo_model: %s\n",
                 std::string(written.message()).c_str());
    return 1;
  }
  std::ofstream config(out + "/config.pbtxt");
  config << "# Demo model: deterministic weights, E=" << e << ", H=" << heads
         << ".\n"
         << "num_heads: " << heads << "\n"
         << "compute_dtype: DATA_TYPE_FLOAT32\n"
         << "description: \"demo multi-head self-attention, E=" << e
         << ", H=" << heads << ", deterministic weights\"\n";
  if (!config) {
    std::fprintf(stderr, "attnserve_demo_model: cannot write %s/config.pbtxt\n",
                 out.c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "attnserve_demo_model --out=DIR [--embed_dim=512] [--num_heads=8]");
  absl::ParseCommandLine(argc, argv);
  return attnserve::Run();
}
