// The front-end files the HTML reports inline: uPlot, d3 and d3-flame-graph
// (npm, pinned in report-assets/package-lock.json) and memfl's own page
// script and style, built into the binary with .incbin so a report needs
// nothing at view time and memfl needs no files at run time.
#pragma once

#include <string_view>

namespace memfl {

enum class ReportAsset { kUplotJs, kUplotCss, kD3Js, kFlamegraphJs, kColorMapperJs, kFlamegraphCss, kPageJs, kPageCss };

std::string_view report_asset(ReportAsset a);

}  // namespace memfl
