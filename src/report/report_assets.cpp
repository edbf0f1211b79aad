#include "report/report_assets.h"

extern "C" {
#define DECLARE(name)       \
  extern const char name[]; \
  extern const char name##_end[];
DECLARE(memfl_asset_uplot_js)
DECLARE(memfl_asset_uplot_css)
DECLARE(memfl_asset_d3_js)
DECLARE(memfl_asset_flamegraph_js)
DECLARE(memfl_asset_flamegraph_css)
DECLARE(memfl_asset_colormapper_js)
DECLARE(memfl_asset_page_js)
DECLARE(memfl_asset_page_css)
#undef DECLARE
}

namespace memfl {

std::string_view report_asset(ReportAsset a) {
  auto view = [](const char* b, const char* e) { return std::string_view(b, static_cast<size_t>(e - b)); };
  switch (a) {
    case ReportAsset::kUplotJs:
      return view(memfl_asset_uplot_js, memfl_asset_uplot_js_end);
    case ReportAsset::kUplotCss:
      return view(memfl_asset_uplot_css, memfl_asset_uplot_css_end);
    case ReportAsset::kD3Js:
      return view(memfl_asset_d3_js, memfl_asset_d3_js_end);
    case ReportAsset::kFlamegraphJs:
      return view(memfl_asset_flamegraph_js, memfl_asset_flamegraph_js_end);
    case ReportAsset::kColorMapperJs:
      return view(memfl_asset_colormapper_js, memfl_asset_colormapper_js_end);
    case ReportAsset::kFlamegraphCss:
      return view(memfl_asset_flamegraph_css, memfl_asset_flamegraph_css_end);
    case ReportAsset::kPageJs:
      return view(memfl_asset_page_js, memfl_asset_page_js_end);
    case ReportAsset::kPageCss:
      return view(memfl_asset_page_css, memfl_asset_page_css_end);
  }
  return {};
}

}  // namespace memfl
