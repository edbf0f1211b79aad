// CompassPlanner: the COMPASS scheduler of FedCompass (Li et al. 2023,
// "FedCompass: efficient cross-silo federated learning on heterogeneous
// client devices using a computing power-aware scheduler"), APPFL's keys.
// It estimates each client's time per local step (an exponential moving
// average with speed_momentum) and gives each client a number of local
// steps in [min_local_steps, max_local_steps] such that clients arrive in
// groups: a client joins the existing group it can reach with the most
// steps, or opens a new group. A group is aggregated when all its clients
// have arrived or at its latest arrival time (expected × latest_time_factor);
// a client that comes after that is late: its update waits in a general
// buffer that joins the next group's aggregation.
//
// Time is whatever clock the caller uses: virtual seconds in the simulator,
// seconds since the start on a real server. The planner holds no models.
//
//   CompassPlanner plan(opts);
//   plan.start(client, 0.0);                           // max_local_steps, no group
//   ... later, the client's update arrives:
//   plan.observe_arrival(client, now);
//   int g = plan.group_of(client);                     // -1: apply alone
//   int steps = plan.assign(client, now);              // its next trip
#pragma once

#include <map>
#include <optional>
#include <vector>

namespace memfl {

struct CompassOptions {
  int max_local_steps = 100;
  int min_local_steps = 20;
  double speed_momentum = 0.9;
  double latest_time_factor = 1.5;
};

class CompassPlanner {
 public:
  explicit CompassPlanner(CompassOptions options) : o_(options) {}

  // The client's update arrived at `now`: its speed estimate takes the
  // measured time per step of this run (the first one sets it).
  void observe_arrival(int client, double now);
  // The group the client was sent off in (-1: none, or the group is gone).
  int group_of(int client) const;
  // Whether `now` is past the group's latest arrival time.
  bool is_late(int group, double now) const;
  // The client arrived in time: it moves from the group's expected clients
  // to its arrived ones. Returns true when none is expected any more.
  bool arrive(int client, int group);
  // The client arrived late: it leaves the group (deleted when empty).
  void leave(int client, int group);
  // The run starts: the client trains max_local_steps in no group (its
  // first arrival is applied alone and measures its speed).
  void start(int client, double now);
  // Gives the client its next group and local steps, starting at `now`.
  // `opened`: set to the new group's id when one was opened (its latest
  // arrival time is a deadline the caller must keep).
  int assign(int client, double now, std::optional<int>* opened = nullptr);
  // A group aggregated: its arrived clients, fastest first (they are
  // assigned again in that order); the group closes (its times go to 0, so
  // a client still expected will be late) and is deleted when no client is
  // expected.
  std::vector<int> close_group(int group);
  bool has_group(int group) const { return groups_.count(group) != 0; }
  double latest_arrival_time(int group) const;
  double speed(int client) const;  // seconds per step (estimate)
  int local_steps(int client) const;

 private:
  struct Client {
    double speed = 0;  // seconds per local step
    int local_steps = 0;
    double start_time = 0;
    int group = -1;
    bool seen = false;
  };
  struct Group {
    std::vector<int> expected, arrived;
    double expected_arrival = 0, latest_arrival = 0;
  };
  bool join_group(int client, double now);
  int create_group(int client, double now);

  CompassOptions o_;
  std::map<int, Client> clients_;
  std::map<int, Group> groups_;
  int next_group_ = 0;
};

}  // namespace memfl
