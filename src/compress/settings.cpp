#include "compress/settings.h"

#include <fmt/format.h>

namespace memfl {

bool CompressionSettings::lossy_tensor(const LayoutEntry& entry) const {
  return lossy != Lossy::kNone && dtype_is_float(entry.dtype) && static_cast<int64_t>(entry.numel()) > param_cutoff &&
         entry.name.find("weight") != std::string::npos;
}

CompressionSettings compression_settings(const ExperimentConfig& cfg) {
  const CompressorConfig& c = cfg.compressor;
  CompressionSettings s;
  s.enabled = c.enable_compression;
  s.lossy_name = c.lossy_compressor;
  if (c.lossy_compressor == "ZFPCompressor") {
    s.lossy = Lossy::kZfp;
  } else if (c.lossy_compressor == "none") {
    s.lossy = Lossy::kNone;
  } else {
    s.lossy = Lossy::kQuantizer;  // the SZ family (the config's schema admits no other name)
  }
  s.lossless = lossless_from_name(c.lossless_compressor).value_or(Lossless::kZstd);
  s.relative = c.error_bounding_mode == "REL";
  s.error_bound = c.error_bound;
  s.param_cutoff = c.param_cutoff;
  s.error_feedback = c.error_feedback && s.lossy != Lossy::kNone;
  s.lossy_broadcast = s.enabled && s.lossy != Lossy::kNone && c.broadcast_compression == "lossy";
  return s;
}

std::string describe_compression(const CompressionSettings& s) {
  if (!s.enabled) return "off";
  std::string lossy = s.lossy == Lossy::kNone ? "no lossy codec"
                                              : fmt::format("{} → {}, {} {}", s.lossy_name, lossy_codec_name(s.lossy),
                                                            s.relative ? "REL" : "ABS", s.error_bound);
  return fmt::format("{}; lossless {}{}{}", lossy, lossless_name(s.lossless),
                     s.error_feedback ? "; error feedback" : "", s.lossy_broadcast ? "; lossy broadcast" : "");
}

nlohmann::ordered_json compression_summary(const CompressionSettings& s) {
  nlohmann::ordered_json j;
  j["enabled"] = s.enabled;
  if (!s.enabled) return j;
  j["lossy_compressor"] = s.lossy_name;
  j["lossy_codec"] = std::string(lossy_codec_name(s.lossy));
  j["lossless_compressor"] = std::string(lossless_name(s.lossless));
  if (s.lossy != Lossy::kNone) {
    j["error_bounding_mode"] = s.relative ? "REL" : "ABS";
    j["error_bound"] = s.error_bound;
    j["param_cutoff"] = s.param_cutoff;
    j["error_feedback"] = s.error_feedback;
    j["broadcast_compression"] = s.lossy_broadcast ? "lossy" : "none";
  }
  return j;
}

}  // namespace memfl
