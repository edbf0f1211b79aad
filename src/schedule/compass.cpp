#include "schedule/compass.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace memfl {

void CompassPlanner::observe_arrival(int client, double now) {
  Client& c = clients_[client];
  const int steps = c.local_steps > 0 ? c.local_steps : o_.max_local_steps;
  const double measured = (now - c.start_time) / static_cast<double>(steps);
  c.speed = c.seen ? (1.0 - o_.speed_momentum) * c.speed + o_.speed_momentum * measured : measured;
  c.seen = true;
}

int CompassPlanner::group_of(int client) const {
  auto it = clients_.find(client);
  if (it == clients_.end() || groups_.count(it->second.group) == 0) return -1;
  return it->second.group;
}

bool CompassPlanner::is_late(int group, double now) const {
  auto it = groups_.find(group);
  return it == groups_.end() || now > it->second.latest_arrival;
}

bool CompassPlanner::arrive(int client, int group) {
  Group& g = groups_.at(group);
  std::erase(g.expected, client);
  g.arrived.push_back(client);
  return g.expected.empty();
}

void CompassPlanner::leave(int client, int group) {
  auto it = groups_.find(group);
  if (it == groups_.end()) return;
  std::erase(it->second.expected, client);
  if (it->second.expected.empty() && it->second.arrived.empty()) groups_.erase(it);
}

std::vector<int> CompassPlanner::close_group(int group) {
  auto it = groups_.find(group);
  if (it == groups_.end()) return {};
  std::vector<int> arrived = std::move(it->second.arrived);
  it->second.arrived.clear();
  std::stable_sort(arrived.begin(), arrived.end(), [&](int a, int b) { return clients_[a].speed < clients_[b].speed; });
  it->second.expected_arrival = 0;
  it->second.latest_arrival = 0;
  if (it->second.expected.empty()) groups_.erase(it);
  return arrived;
}

double CompassPlanner::latest_arrival_time(int group) const {
  auto it = groups_.find(group);
  return it == groups_.end() ? 0.0 : it->second.latest_arrival;
}

double CompassPlanner::speed(int client) const {
  auto it = clients_.find(client);
  return it == clients_.end() ? 0.0 : it->second.speed;
}

int CompassPlanner::local_steps(int client) const {
  auto it = clients_.find(client);
  return it == clients_.end() ? o_.max_local_steps : it->second.local_steps;
}

void CompassPlanner::start(int client, double now) {
  Client& c = clients_[client];
  c.local_steps = o_.max_local_steps;
  c.start_time = now;
  c.group = -1;
}

int CompassPlanner::assign(int client, double now, std::optional<int>* opened) {
  if (opened != nullptr) opened->reset();
  Client& c = clients_[client];
  if (join_group(client, now)) return c.local_steps;
  const int g = create_group(client, now);
  if (opened != nullptr) *opened = g;
  return c.local_steps;
}

bool CompassPlanner::join_group(int client, double now) {
  Client& c = clients_[client];
  int best = -1, best_steps = -1;
  for (const auto& [id, g] : groups_) {
    if (g.expected_arrival <= now) continue;  // closed, or due already
    const int steps = static_cast<int>(std::floor((g.expected_arrival - now) / c.speed));
    if (steps < o_.min_local_steps || steps > o_.max_local_steps || steps < best_steps) continue;
    best = id;
    best_steps = steps;
  }
  if (best < 0) return false;
  groups_[best].expected.push_back(client);
  c.group = best;
  c.local_steps = best_steps;
  c.start_time = now;
  return true;
}

int CompassPlanner::create_group(int client, double now) {
  Client& c = clients_[client];
  // Aim the new group just after an open group's latest arrival plus the
  // time its fastest client needs for max_local_steps, so that fast clients
  // can join it on their next trip.
  int steps = -1;
  for (const auto& [id, g] : groups_) {
    if (now >= g.latest_arrival) continue;
    double fastest = std::numeric_limits<double>::infinity();
    for (int m : g.expected) fastest = std::min(fastest, clients_[m].speed);
    for (int m : g.arrived) fastest = std::min(fastest, clients_[m].speed);
    const double arrival = g.latest_arrival + fastest * o_.max_local_steps;
    const int s = static_cast<int>(std::floor((arrival - now) / c.speed));
    if (s <= o_.max_local_steps) steps = std::max(steps, s);
  }
  if (steps >= 0 && steps < o_.min_local_steps) steps = o_.min_local_steps;
  if (steps < 0) steps = o_.max_local_steps;
  const int id = next_group_++;
  Group& g = groups_[id];
  g.expected.push_back(client);
  g.expected_arrival = now + steps * c.speed;
  g.latest_arrival = now + steps * c.speed * o_.latest_time_factor;
  c.group = id;
  c.local_steps = steps;
  c.start_time = now;
  return id;
}

}  // namespace memfl
