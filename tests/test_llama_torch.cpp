// memfl's Llama module (train/llama_module.h) against independent forms: the
// loss over the vocabulary in chunks against full logits, the module's
// hand-written backward passes (RMSNorm, SwiGLU, chunked loss, checkpointed
// blocks) against autograd through a Llama composed here from plain torch
// ops, fused attention against the math form, and the logits against a
// Llama written in Python (tests/python/llama_oracle.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>

#include "model/lora.h"

#include "train/dp_sgd.h"
#include "train/llama_module.h"

namespace memfl::torch_internal {
namespace {

double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(1e-12, b.abs().max().item<double>());
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>() / scale;
}

LlamaSpec tiny_spec() {
  LlamaSpec s;
  s.name = "llama";
  s.hidden_size = 32;
  s.num_layers = 2;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.intermediate_size = 48;
  s.vocab_size = 40;
  return s;
}

// LoRA adapters by the linear layer's Hugging Face prefix
// ("model.layers.0.self_attn.q_proj"): (A [r, in], B [out, r]).
using Adapters = std::map<std::string, std::pair<torch::Tensor, torch::Tensor>>;

// The Llama of the published architecture, written with autograd's own ops
// on the module's parameters (by name), so its gradients are autograd's.
// With `lora`, each adapted linear layer is x Wᵀ + scale · (x Aᵀ) Bᵀ — LoRA's
// formula (Hu et al.), not memfl's modules.
torch::Tensor composed_loss(torch::nn::Module& net, const LlamaSpec& s, const torch::Tensor& x,
                            const torch::Tensor& y, const Adapters* lora = nullptr, double scale = 0) {
  auto p = [&](const std::string& name) { return net.named_parameters()[name]; };
  auto lin = [&](const torch::Tensor& v, const std::string& name) {
    auto out = torch::matmul(v, p(name + ".weight").t());
    if (lora != nullptr) {
      if (auto it = lora->find(name); it != lora->end()) {
        out = out + scale * torch::matmul(torch::matmul(v, it->second.first.t()), it->second.second.t());
      }
    }
    return out;
  };
  auto rms = [&](const torch::Tensor& v, const torch::Tensor& w) {
    return w * (v * torch::rsqrt(v.pow(2).mean(-1, true) + s.rms_norm_eps));
  };
  const int64_t b = x.size(0), t = x.size(1), hd = s.head_dim();
  auto h = torch::embedding(p("model.embed_tokens.weight"), x);
  auto inv = torch::pow(s.rope_theta, -torch::arange(0, hd, 2, torch::kFloat32) / static_cast<double>(hd));
  auto ang = torch::outer(torch::arange(t, torch::kFloat32), inv);
  auto cos = torch::cat({ang.cos(), ang.cos()}, -1), sin = torch::cat({ang.sin(), ang.sin()}, -1);
  auto rope = [&](const torch::Tensor& v) {
    auto x1 = v.narrow(-1, 0, hd / 2), x2 = v.narrow(-1, hd / 2, hd / 2);
    return v * cos + torch::cat({-x2, x1}, -1) * sin;
  };
  auto mask = torch::full({t, t}, -INFINITY).triu(1);
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    auto a = rms(h, p(l + "input_layernorm.weight"));
    auto q = rope(lin(a, l + "self_attn.q_proj").view({b, t, s.num_heads, hd}).transpose(1, 2));
    auto k = rope(lin(a, l + "self_attn.k_proj").view({b, t, s.num_kv_heads, hd}).transpose(1, 2));
    auto v = lin(a, l + "self_attn.v_proj").view({b, t, s.num_kv_heads, hd}).transpose(1, 2);
    const int64_t rep = s.num_heads / s.num_kv_heads;
    k = k.repeat_interleave(rep, 1);
    v = v.repeat_interleave(rep, 1);
    auto att =
        torch::matmul(torch::softmax(torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(double(hd)) + mask, -1), v);
    h = h + lin(att.transpose(1, 2).reshape({b, t, -1}), l + "self_attn.o_proj");
    auto m = rms(h, p(l + "post_attention_layernorm.weight"));
    auto g = lin(m, l + "mlp.gate_proj");
    auto u = lin(m, l + "mlp.up_proj");
    h = h + lin(torch::silu(g) * u, l + "mlp.down_proj");
  }
  auto logits = torch::matmul(rms(h, p("model.norm.weight")), p("lm_head.weight").t());
  return torch::nn::functional::cross_entropy(logits.reshape({-1, s.vocab_size}), y.reshape({-1}));
}

std::vector<torch::Tensor> grads_of(torch::nn::Module& net) {
  std::vector<torch::Tensor> g;
  for (auto& p : net.parameters()) g.push_back(p.grad().clone());
  for (auto& p : net.parameters()) p.mutable_grad() = torch::Tensor();
  return g;
}

TEST(LlamaTorch, ChunkedLossAndGradientsMatchFullLogits) {
  torch::manual_seed(3);
  // 37 rows in chunks of 8: the last chunk is partial.
  auto h = torch::randn({37, 16}).requires_grad_(true);
  auto w = torch::randn({50, 16}).requires_grad_(true);
  auto y = torch::randint(0, 50, {37}, torch::kInt64);
  auto [loss, correct] = linear_cross_entropy(h, w, y, 8);
  loss.mul(2.5).backward();  // a scale on the loss must reach both gradients
  auto gh = h.grad().clone(), gw = w.grad().clone();
  h.mutable_grad() = torch::Tensor();
  w.mutable_grad() = torch::Tensor();
  auto logits = torch::matmul(h, w.t());
  auto ref = torch::nn::functional::cross_entropy(logits, y);
  ref.mul(2.5).backward();
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5);
  EXPECT_EQ(correct.item<int64_t>(), logits.argmax(-1).eq(y).sum().item<int64_t>());
  EXPECT_LT(max_rel_diff(gh, h.grad()), 1e-5);
  EXPECT_LT(max_rel_diff(gw, w.grad()), 1e-5);
}

// Targets of -100 (a loss mask's padding or prompt) are no targets: the
// chunked loss, its count and its gradients equal torch's cross_entropy with
// ignore_index -100 over the full logits — the mean over the 25 rows that
// count, not the 37 — with masked rows in several chunks, one chunk all
// masked.
TEST(LlamaTorch, ChunkedLossSkipsIgnoredTargetsAsTorchDoes) {
  torch::manual_seed(5);
  auto h = torch::randn({37, 16}).requires_grad_(true);
  auto w = torch::randn({50, 16}).requires_grad_(true);
  auto y = torch::randint(0, 50, {37}, torch::kInt64);
  for (int64_t i : {0, 3, 9, 17, 30, 36}) y[i] = -100;
  y.narrow(0, 8, 8).fill_(-100);                         // rows 8..15: the second chunk of 8, all masked
  ASSERT_EQ(y.ge(0).sum().item<int64_t>(), 37 - 6 - 7);  // row 9 is in both
  auto [loss, correct] = linear_cross_entropy(h, w, y, 8);
  loss.mul(1.5).backward();
  auto gh = h.grad().clone(), gw = w.grad().clone();
  h.mutable_grad() = torch::Tensor();
  w.mutable_grad() = torch::Tensor();
  auto logits = torch::matmul(h, w.t());
  auto ref = torch::nn::functional::cross_entropy(logits, y,
                                                  torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
  ref.mul(1.5).backward();
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5);
  EXPECT_EQ(correct.item<int64_t>(), logits.argmax(-1).eq(y).sum().item<int64_t>());
  EXPECT_LT(max_rel_diff(gh, h.grad()), 1e-5);
  EXPECT_LT(max_rel_diff(gw, w.grad()), 1e-5);
  // The masked rows get no gradient at all.
  EXPECT_EQ(gh.narrow(0, 8, 8).abs().max().item<float>(), 0.0f);
}

TEST(LlamaTorch, GradientsMatchAutogradThroughAComposedLlama) {
  const LlamaSpec s = tiny_spec();
  torch::manual_seed(11);
  LlamaOptions o;
  o.fused_attention = false;
  auto net = make_llama(s, o);
  {
    // Norm weights away from 1, so a wrong norm gradient or weight shows.
    torch::NoGradGuard g;
    for (auto& kv : net->named_parameters()) {
      if (kv.value().dim() == 1) kv.value().add_(torch::randn_like(kv.value()) * 0.2);
    }
  }
  net->train();
  auto x = torch::randint(0, s.vocab_size, {3, 9}, torch::kInt64);
  auto y = torch::randint(0, s.vocab_size, {3, 9}, torch::kInt64);
  auto [loss, correct] = net->loss_and_correct(x, y);
  loss.backward();
  auto got = grads_of(*net);
  auto ref = composed_loss(*net, s, x, y);
  ref.backward();
  auto want = grads_of(*net);
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5);
  auto names = net->named_parameters().keys();
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_LT(max_rel_diff(got[i], want[i]), 1e-4) << names[i];
  }
}

// LoRA over a frozen base: the loss and the adapters' gradients equal the
// formula's through autograd (every linear layer x Wᵀ + (α/r)·x Aᵀ Bᵀ), the
// base gets no gradient, and the tensors that bind to the arena are the
// adapters alone, by PEFT's names and in lora_layout()'s order.
TEST(LlamaTorch, LoraForwardAndBackwardMatchTheFormulaOverAFrozenBase) {
  const LlamaSpec s = tiny_spec();
  torch::manual_seed(13);
  LlamaOptions plain;
  plain.fused_attention = false;
  auto base_net = make_llama(s, plain);
  std::map<std::string, torch::Tensor> base;
  for (auto& kv : base_net->named_parameters()) base[kv.key()] = kv.value().detach();
  LoraConfig lora;
  lora.enabled = true;
  lora.r = 3;
  lora.lora_alpha = 7.5;  // scale 2.5
  lora.target_modules = {"q_proj", "v_proj", "o_proj", "up_proj", "down_proj"};
  LlamaOptions o = plain;
  o.lora = &lora;
  o.base = &base;
  auto net = make_llama(s, o);
  auto named = net->named_tensors();
  auto layout = lora_layout(s, lora);
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(named.size(), layout->size());
  for (size_t i = 0; i < named.size(); ++i) {
    EXPECT_EQ(named[i].first, layout->entries()[i].name);
    EXPECT_EQ(named[i].second.sizes().vec(), layout->entries()[i].shape) << named[i].first;
  }
  // B away from zero (as after training), so both matrices shape the output.
  {
    torch::NoGradGuard g;
    for (auto& [name, t] : named) t.copy_(torch::randn_like(t) * 0.3);
  }
  // The same base tensors, not copies: one base for every network over it.
  EXPECT_EQ(net->named_parameters()["model.layers.1.mlp.up_proj.weight"].data_ptr(),
            base["model.layers.1.mlp.up_proj.weight"].data_ptr());
  net->train();
  auto x = torch::randint(0, s.vocab_size, {2, 7}, torch::kInt64);
  auto y = torch::randint(0, s.vocab_size, {2, 7}, torch::kInt64);
  auto [loss, correct] = net->loss_and_correct(x, y);
  loss.backward();
  for (auto& kv : net->named_parameters()) {
    if (kv.key().find("lora_") == std::string::npos) {
      EXPECT_FALSE(kv.value().grad().defined()) << kv.key() << ": a frozen base weight got a gradient";
    }
  }
  // The formula on copies of the adapters, keyed by their linear layer.
  Adapters ref_adapters;
  std::vector<std::pair<std::string, torch::Tensor>> ref_leaves;
  for (size_t i = 0; i < named.size(); i += 2) {
    const std::string& a_name = named[i].first;  // base_model.model.<prefix>.lora_A.weight
    const std::string prefix = a_name.substr(std::string("base_model.model.").size(),
                                             a_name.size() - std::string("base_model.model.").size() -
                                                 std::string(".lora_A.weight").size());
    auto a = named[i].second.detach().clone().requires_grad_(true);
    auto b = named[i + 1].second.detach().clone().requires_grad_(true);
    ref_adapters[prefix] = {a, b};
    ref_leaves.emplace_back(named[i].first, a);
    ref_leaves.emplace_back(named[i + 1].first, b);
  }
  auto ref = composed_loss(*net, s, x, y, &ref_adapters, 2.5);
  ref.backward();
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5);
  // The base alone gives another loss: the adapters count.
  EXPECT_GT(std::abs(composed_loss(*net, s, x, y).item<double>() - ref.item<double>()), 1e-3);
  for (size_t i = 0; i < named.size(); ++i) {
    ASSERT_TRUE(named[i].second.grad().defined()) << named[i].first;
    EXPECT_LT(max_rel_diff(named[i].second.grad(), ref_leaves[i].second.grad()), 1e-4) << named[i].first;
  }
}

// DP-SGD on LoRA adapters over a frozen base: with no noise the gradient
// DpSgd writes is Σ_i c_i g_i / E[B], where g_i is sequence i's gradient over
// every adapter — here from autograd through the composed formula on that
// sequence alone, its loss its counted tokens' summed cross-entropy ÷ T — and
// c_i = min(1, C / (‖g_i‖ + 1e-6)); the norms it reports are the ‖g_i‖. The
// same with checkpointed blocks, whose adapters record in the recomputation.
TEST(LlamaTorch, DpSgdOnLoraAdaptersClipsEachSequencesGradientOverAFrozenBase) {
  const LlamaSpec s = tiny_spec();
  torch::manual_seed(17);
  LlamaOptions plain;
  plain.fused_attention = false;
  auto base_net = make_llama(s, plain);
  std::map<std::string, torch::Tensor> base;
  for (auto& kv : base_net->named_parameters()) base[kv.key()] = kv.value().detach();
  LoraConfig lora;
  lora.enabled = true;
  lora.r = 3;
  lora.lora_alpha = 6;  // scale 2
  lora.target_modules = {"q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"};
  LlamaOptions o = plain;
  o.lora = &lora;
  o.base = &base;
  auto net = make_llama(s, o);
  auto named = net->named_tensors();
  {
    torch::NoGradGuard g;
    for (auto& [name, t] : named) t.copy_(torch::randn_like(t) * 0.3);
  }
  const int64_t batch = 3, seq = 6;
  auto x = torch::randint(0, s.vocab_size, {batch, seq}, torch::kInt64);
  auto y = torch::randint(0, s.vocab_size, {batch, seq}, torch::kInt64);
  y[1].narrow(0, 2, 3).fill_(-100);  // sequence 1 counts 3 of its 6 targets
  net->train();

  // Each sequence's adapter gradient from the formula, one sequence at a time.
  std::vector<std::vector<torch::Tensor>> per_sample;
  std::vector<double> norms;
  for (int64_t i = 0; i < batch; ++i) {
    Adapters ref;
    std::vector<torch::Tensor> leaves;
    for (size_t k = 0; k < named.size(); k += 2) {
      const std::string& a_name = named[k].first;
      const std::string prefix = a_name.substr(std::string("base_model.model.").size(),
                                               a_name.size() - std::string("base_model.model.").size() -
                                                   std::string(".lora_A.weight").size());
      auto a = named[k].second.detach().clone().requires_grad_(true);
      auto b = named[k + 1].second.detach().clone().requires_grad_(true);
      ref[prefix] = {a, b};
      leaves.push_back(a);
      leaves.push_back(b);
    }
    auto yi = y.narrow(0, i, 1);
    const double counted = static_cast<double>(yi.ge(0).sum().item<int64_t>());
    (composed_loss(*net, s, x.narrow(0, i, 1), yi, &ref, 2.0) * (counted / seq)).backward();
    double sq = 0;
    std::vector<torch::Tensor> g;
    for (auto& l : leaves) {
      g.push_back(l.grad().to(torch::kFloat64));
      sq += l.grad().to(torch::kFloat64).pow(2).sum().item<double>();
    }
    per_sample.push_back(std::move(g));
    norms.push_back(std::sqrt(sq));
  }
  std::vector<double> sorted = norms;
  std::sort(sorted.begin(), sorted.end());
  ASSERT_LT(sorted[0] * 1.01, sorted[1]) << "the sequences' norms must differ for the bound to clip some only";
  const double c_max = 0.5 * (sorted[0] + sorted[1]);  // the smallest passes whole, the others are clipped
  const double expected_batch = 2.5;
  std::vector<torch::Tensor> want;
  for (size_t j = 0; j < named.size(); ++j) {
    torch::Tensor sum = torch::zeros_like(per_sample[0][j]);
    for (int64_t i = 0; i < batch; ++i) sum += std::min(1.0, c_max / (norms[i] + 1e-6)) * per_sample[i][j];
    want.push_back(sum / expected_batch);
  }

  dp::DpOptions opt;
  opt.max_grad_norm = c_max;
  opt.noise_multiplier = 0;
  for (bool checkpointed : {false, true}) {
    SCOPED_TRACE(checkpointed ? "checkpointed blocks" : "plain blocks");
    net->set_gradient_checkpointing(checkpointed);
    auto created = dp::DpSgd::create(net, opt);
    ASSERT_TRUE(created.ok()) << created.status().to_string();
    auto dpsgd = std::move(*created);
    auto [mean, right] = net->loss_and_correct(x, y);
    const double counted = static_cast<double>(y.ge(0).sum().item<int64_t>());
    (mean * (counted / seq)).backward();
    auto got_norms = dpsgd->per_sample_norms();
    ASSERT_EQ(got_norms.size(0), batch);
    for (int64_t i = 0; i < batch; ++i) EXPECT_NEAR(got_norms[i].item<double>(), norms[i], 1e-4 * norms[i]) << i;
    auto st = dpsgd->step(expected_batch);
    ASSERT_TRUE(st.ok()) << st.status().to_string();
    EXPECT_NEAR(st->clipped_fraction, 2.0 / 3.0, 1e-9);
    for (size_t j = 0; j < named.size(); ++j) {
      ASSERT_TRUE(named[j].second.grad().defined()) << named[j].first;
      EXPECT_LT(max_rel_diff(named[j].second.grad(), want[j]), 1e-4) << named[j].first;
      named[j].second.mutable_grad() = torch::Tensor();
    }
    for (auto& kv : net->named_parameters()) {
      if (kv.key().find("lora_") == std::string::npos) {
        EXPECT_FALSE(kv.value().grad().defined()) << kv.key() << ": a frozen base weight got a gradient";
      }
    }
  }
  // A Llama whose base trains has parameters outside any DP layer: refused.
  auto full = make_llama(s, plain);
  auto refused = dp::DpSgd::create(full, opt);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("cannot clip parameter"), std::string::npos)
      << refused.status().message();
}

TEST(LlamaTorch, CheckpointedBlocksGiveTheSameGradients) {
  const LlamaSpec s = tiny_spec();
  torch::manual_seed(5);
  auto net = make_llama(s);
  net->train();
  auto x = torch::randint(0, s.vocab_size, {2, 12}, torch::kInt64);
  auto y = torch::randint(0, s.vocab_size, {2, 12}, torch::kInt64);
  net->loss_and_correct(x, y).first.backward();
  auto plain = grads_of(*net);
  net->set_gradient_checkpointing(true);
  net->loss_and_correct(x, y).first.backward();
  auto recomputed = grads_of(*net);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_LT(max_rel_diff(recomputed[i], plain[i]), 1e-6) << i;
}

TEST(LlamaTorch, FusedAttentionMatchesTheMathForm) {
  if (!fused_attention_available()) GTEST_SKIP() << "this libtorch has no scaled_dot_product_attention";
  torch::manual_seed(2);
  auto q = torch::randn({2, 4, 33, 16}).requires_grad_(true);
  auto k = torch::randn({2, 4, 33, 16}).requires_grad_(true);
  auto v = torch::randn({2, 4, 33, 16}).requires_grad_(true);
  auto w = torch::randn({2, 4, 33, 16});
  (causal_attention(q, k, v, true) * w).sum().backward();
  auto g1 = std::vector<torch::Tensor>{q.grad().clone(), k.grad().clone(), v.grad().clone()};
  auto fused = causal_attention(q, k, v, true).detach();
  for (auto* t : {&q, &k, &v}) t->mutable_grad() = torch::Tensor();
  (causal_attention_math(q, k, v) * w).sum().backward();
  // f32 on the CPU: only the summation order differs.
  EXPECT_LT(max_rel_diff(fused, causal_attention_math(q, k, v).detach()), 1e-5);
  EXPECT_LT(max_rel_diff(g1[0], q.grad()), 1e-4);
  EXPECT_LT(max_rel_diff(g1[1], k.grad()), 1e-4);
  EXPECT_LT(max_rel_diff(g1[2], v.grad()), 1e-4);
}

// The Python oracle exits 0 when memfl's logits and loss on its checkpoint
// agree with its own Llama within the dtype's tolerance.
TEST(LlamaTorch, LogitsMatchAnIndependentPythonLlama) {
  for (const char* dtype : {"f32", "bf16"}) {
    const std::string cmd = std::string("/usr/bin/python3 ") + MEMFL_SOURCE_DIR +
                            "/tests/python/llama_oracle.py --memfl " + MEMFL_BINARY + " --oracle torch --dtype " +
                            dtype;
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
}

}  // namespace
}  // namespace memfl::torch_internal
