// Rendezvous: see rendezvous.h.
#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sstream>

namespace gpt2::dist {

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  const size_t shown = ranks.size() > 8 ? 8 : ranks.size();
  for (size_t i = 0; i < shown; i++) s << (i ? ", " : "") << ranks[i];
  if (shown < ranks.size()) s << ", ... (" << ranks.size() << " ranks)";
  return s.str();
}

namespace {

bool is_loopback(const std::string& host) {
  if (host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0) return true;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res) return false;
  const auto* a = reinterpret_cast<const sockaddr_in*>(res->ai_addr);
  const bool lo = (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  ::freeaddrinfo(res);
  return lo;
}

}  // namespace

std::string local_address(const RendezvousOptions& o) {
  if (!o.hostname.empty()) return o.hostname;
  if (is_loopback(o.master_addr)) return "127.0.0.1";
  // The source address of the route to the master (a UDP connect sends nothing).
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_DGRAM;
  std::string out;
  if (::getaddrinfo(o.master_addr.c_str(), std::to_string(o.master_port).c_str(), &hints, &res) == 0) {
    for (addrinfo* a = res; a && out.empty(); a = a->ai_next) {
      int fd = ::socket(a->ai_family, SOCK_DGRAM, 0);
      if (fd < 0) continue;
      sockaddr_storage local{};
      socklen_t len = sizeof(local);
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
          ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
        char buf[INET6_ADDRSTRLEN] = {0};
        const void* src = local.ss_family == AF_INET
                              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
        if (::inet_ntop(local.ss_family, src, buf, sizeof(buf))) out = buf;
      }
      ::close(fd);
    }
    ::freeaddrinfo(res);
  }
  if (out.empty()) {
    char name[256] = {0};
    ::gethostname(name, sizeof(name) - 1);
    out = name;
  }
  return out;
}

std::unique_ptr<TcpStore> rendezvous(const RendezvousOptions& o) {
  if (o.world_size < 1) throw DistError("world_size must be >= 1, got " + std::to_string(o.world_size));
  if (o.rank < 0 || o.rank >= o.world_size)
    throw DistError("rank " + std::to_string(o.rank) + " is outside 0.." + std::to_string(o.world_size - 1));
  auto store = std::make_unique<TcpStore>(o.master_addr, o.master_port, o.rank == 0, o.timeout);
  const std::string p = o.prefix + "/";
  const std::string ws = std::to_string(o.world_size);
  if (o.rank == 0) store->set(p + "world_size", std::vector<char>(ws.begin(), ws.end()));
  const std::string me = local_address(o);
  store->set(p + "join/" + std::to_string(o.rank), std::vector<char>(me.begin(), me.end()));

  auto theirs = store->get(p + "world_size", o.timeout);
  if (std::string(theirs.begin(), theirs.end()) != ws) {
    std::ostringstream s;
    s << "rendezvous at " << o.master_addr << ":" << o.master_port << ": rank " << o.rank << " has WORLD_SIZE="
      << ws << " but rank 0 has WORLD_SIZE=" << std::string(theirs.begin(), theirs.end());
    throw DistError(s.str());
  }

  std::vector<std::string> keys;
  for (int r = 0; r < o.world_size; r++) keys.push_back(p + "join/" + std::to_string(r));
  auto missing = store->wait(keys, o.timeout);
  if (!missing.empty()) {
    std::vector<int> ranks;
    for (const auto& k : missing) ranks.push_back(std::stoi(k.substr(k.rfind('/') + 1)));
    std::ostringstream s;
    s << "rendezvous at " << o.master_addr << ":" << o.master_port << " timed out after "
      << o.timeout.count() / 1000.0 << " s on rank " << o.rank << ": rank" << (ranks.size() > 1 ? "s " : " ")
      << rank_list(ranks) << " of " << o.world_size << " never joined (not started, crashed before "
      << "joining, or started with a different MASTER_ADDR/MASTER_PORT)";
    throw DistError(s.str());
  }
  return store;
}

}  // namespace gpt2::dist
