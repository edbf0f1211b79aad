#include "memory/profile.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>

namespace memfl {

namespace {
class Reader {
 public:
  explicit Reader(const std::string& bytes) : b_(bytes) {}
  template <typename T>
  bool get(T* v) {
    if (pos_ + sizeof(T) > b_.size()) return false;
    std::memcpy(v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool str(size_t n, std::string* s) {
    if (pos_ + n > b_.size()) return false;
    s->assign(b_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }
  bool done() const { return pos_ >= b_.size(); }

 private:
  const std::string& b_;
  size_t pos_ = 0;
};
}  // namespace

std::vector<std::string> Profile::frames_of(uint32_t stack) const {
  std::vector<std::string> out;
  auto it = stacks.find(stack);
  if (it == stacks.end()) return {"[unknown]"};
  for (auto f = it->second.rbegin(); f != it->second.rend(); ++f) {
    auto s = symbols.find(*f);
    out.push_back(s != symbols.end() ? s->second : fmt::format("0x{:x}", *f));
  }
  return out;
}

StatusOr<Profile> read_profile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("profile {} cannot be read", path);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  Reader r(bytes);
  Profile p;
  char magic[8];
  if (bytes.size() < 8 || std::memcmp(bytes.data(), kProfileMagic, 8) != 0) {
    return data_loss("{}: not a memfl profile (bad magic)", path);
  }
  std::string skip;
  r.str(8, &skip);
  (void)magic;
  uint16_t rl = 0;
  if (!r.get(&p.version) || !r.get(&p.pid) || !r.get(&p.threshold) || !r.get(&rl) || !r.str(rl, &p.role)) {
    return data_loss("{}: truncated header", path);
  }
  if (p.version != kProfileVersion) {
    return data_loss("{}: profile version {} (this memfl reads version {})", path, p.version, kProfileVersion);
  }
  std::unordered_map<uint64_t, std::pair<uint64_t, uint32_t>> live;  // ptr -> size, stack
  while (!r.done()) {
    const size_t record_start = r.pos();
    uint8_t type = 0;
    r.get(&type);
    bool ok = true;
    switch (type) {
      case kRecStack: {
        uint32_t id = 0;
        uint16_t n = 0;
        ok = r.get(&id) && r.get(&n);
        std::vector<uint64_t> frames(ok ? n : 0);
        for (uint16_t i = 0; ok && i < n; ++i) ok = r.get(&frames[i]);
        if (ok) p.stacks[id] = std::move(frames);
        break;
      }
      case kRecAlloc: {
        uint64_t t, ptr, size;
        uint32_t stack;
        ok = r.get(&t) && r.get(&ptr) && r.get(&size) && r.get(&stack);
        if (ok) {
          live[ptr] = {size, stack};
          p.events.push_back({t, static_cast<int64_t>(size), stack});
        }
        break;
      }
      case kRecFree: {
        uint64_t t, ptr;
        ok = r.get(&t) && r.get(&ptr);
        if (ok) {
          auto it = live.find(ptr);
          if (it == live.end()) {
            p.unmatched_frees++;
          } else {
            p.events.push_back({t, -static_cast<int64_t>(it->second.first), it->second.second});
            live.erase(it);
          }
        }
        break;
      }
      case kRecMark: {
        Profile::Mark m;
        uint16_t n;
        ok = r.get(&m.t_us) && r.get(&m.round) && r.get(&n) && r.str(n, &m.phase);
        if (ok) p.marks.push_back(std::move(m));
        break;
      }
      case kRecSmall: {
        Profile::Small s;
        ok = r.get(&s.t_us) && r.get(&s.current) && r.get(&s.count);
        if (ok) p.small.push_back(s);
        break;
      }
      case kRecSymbol: {
        uint64_t addr;
        uint16_t n;
        std::string name;
        ok = r.get(&addr) && r.get(&n) && r.str(n, &name);
        if (ok) p.symbols[addr] = std::move(name);
        break;
      }
      case kRecHeap: {
        Profile::Heap h;
        ok = r.get(&h.t_us) && r.get(&h.free_retained) && r.get(&h.heap_total) && r.get(&h.mmapped) &&
             r.get(&h.profiler_own);
        if (ok) p.heap.push_back(h);
        break;
      }
      default:
        return data_loss("{}: unknown record type {} at byte {}", path, type, record_start);
    }
    if (!ok) {
      p.truncated = true;  // the process died mid-write: keep what came before
      p.bytes_read = record_start;
      return p;
    }
  }
  p.bytes_read = bytes.size();
  return p;
}

ProfileAnalysis analyse_profile(const Profile& p) {
  ProfileAnalysis a;
  int64_t current = 0;
  size_t peak_index = 0;
  std::unordered_map<uint32_t, SiteBytes> total;
  for (size_t i = 0; i < p.events.size(); ++i) {
    const auto& e = p.events[i];
    current += e.delta;
    a.timeline.emplace_back(e.t_us, current);
    if (current > a.peak_tracked_bytes) {
      a.peak_tracked_bytes = current;
      a.peak_t_us = e.t_us;
      peak_index = i + 1;
    }
    if (e.delta > 0) {
      auto& s = total[e.stack];
      s.stack = e.stack;
      s.bytes += e.delta;
      s.count++;
    }
  }
  // The live set at the peak: replay up to it.
  std::unordered_map<uint32_t, SiteBytes> live;
  for (size_t i = 0; i < peak_index; ++i) {
    auto& s = live[p.events[i].stack];
    s.stack = p.events[i].stack;
    s.bytes += p.events[i].delta;
    s.count += p.events[i].delta > 0 ? 1 : -1;
  }
  for (auto& [id, s] : live) {
    if (s.bytes > 0) a.live_at_peak.push_back(s);
  }
  for (auto& [id, s] : total) a.total_allocated.push_back(s);
  auto by_bytes = [](const SiteBytes& x, const SiteBytes& y) {
    return x.bytes != y.bytes ? x.bytes > y.bytes : x.stack < y.stack;
  };
  std::sort(a.live_at_peak.begin(), a.live_at_peak.end(), by_bytes);
  std::sort(a.total_allocated.begin(), a.total_allocated.end(), by_bytes);
  for (const auto& m : p.marks) {
    if (m.t_us > a.peak_t_us) break;
    a.peak_phase = m.phase;
    a.peak_round = m.round;
  }
  for (const auto& s : p.small) {
    if (s.t_us > a.peak_t_us) break;
    a.small_at_peak = s.current;
  }
  for (const auto& h : p.heap) {
    if (h.t_us > a.peak_t_us && a.malloc_free_retained_at_peak != 0) break;
    a.malloc_free_retained_at_peak = h.free_retained;
  }
  return a;
}

Accounting accounting_at(const Profile& p, const ProfileAnalysis& a, uint64_t t_us) {
  Accounting acc;
  auto it = std::upper_bound(a.timeline.begin(), a.timeline.end(), t_us,
                             [](uint64_t t, const std::pair<uint64_t, int64_t>& e) { return t < e.first; });
  if (it != a.timeline.begin()) acc.tracked = std::prev(it)->second;
  for (const auto& s : p.small) {
    if (s.t_us > t_us && acc.small != 0) break;
    acc.small = s.current;
  }
  for (const auto& h : p.heap) {
    if (h.t_us > t_us && acc.malloc_kept != 0) break;
    acc.malloc_kept = h.free_retained;
    acc.profiler_own = h.profiler_own;
  }
  return acc;
}

std::string folded_stacks(const Profile& p, const std::vector<SiteBytes>& sites) {
  std::string out;
  for (const auto& s : sites) {
    auto frames = p.frames_of(s.stack);
    std::string line;
    for (size_t i = 0; i < frames.size(); ++i) {
      std::string f = frames[i];
      std::replace(f.begin(), f.end(), ';', ',');  // ';' separates frames
      std::replace(f.begin(), f.end(), ' ', '_');  // flamegraph.pl splits the count on the last space
      line += (i ? ";" : "") + f;
    }
    out += fmt::format("{} {}\n", line.empty() ? "[unknown]" : line, s.bytes);
  }
  return out;
}

std::string describe_profile(const Profile& p, const ProfileAnalysis& a) {
  std::string out = fmt::format("profile v{} role={} threshold={} truncated={}\n", p.version, p.role, p.threshold,
                                p.truncated ? "yes" : "no");
  out += fmt::format("stacks={} events={} marks={} unmatched_frees={}\n", p.stacks.size(), p.events.size(),
                     p.marks.size(), p.unmatched_frees);
  out += fmt::format("peak_tracked_bytes={} at round {} phase {}\n", a.peak_tracked_bytes, a.peak_round,
                     a.peak_phase.empty() ? "-" : a.peak_phase);
  for (const auto& s : a.live_at_peak) {
    auto frames = p.frames_of(s.stack);
    out += fmt::format("live {} bytes in {} at {}\n", s.bytes, s.count, frames.empty() ? "?" : frames.back());
  }
  return out;
}

}  // namespace memfl
