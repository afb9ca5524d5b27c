// TcpStore: see tcp_store.h for the protocol. The server is one thread multiplexing all clients with
// poll(2); a pipe wakes it for shutdown.
#include "comm/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <sstream>

#include "comm/comm.h"

namespace gpt2::dist {

namespace {

using Clock = std::chrono::steady_clock;

std::string errno_str(int e) { return std::string(std::strerror(e)); }

std::string endpoint(const std::string& host, int port) { return host + ":" + std::to_string(port); }

void put_u32(std::vector<char>& out, uint32_t v) {
  char b[4];
  std::memcpy(b, &v, 4);
  out.insert(out.end(), b, b + 4);
}

uint32_t get_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Writes all of buf; false when the peer is gone.
bool write_all(int fd, const char* buf, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, buf, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    buf += w;
    n -= size_t(w);
  }
  return true;
}

// Reads exactly n bytes before the deadline; throws DistError otherwise.
void read_exact(int fd, char* buf, size_t n, Clock::time_point deadline, const std::string& what) {
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) throw DistError(what + ": timed out waiting for the rendezvous store's reply");
    pollfd p{fd, POLLIN, 0};
    int rc = ::poll(&p, 1, int(left > 1000 ? 1000 : left));
    if (rc < 0) {
      if (errno == EINTR) continue;
      throw DistError(what + ": poll failed: " + errno_str(errno));
    }
    if (rc == 0) continue;
    ssize_t r = ::recv(fd, buf, n, 0);
    if (r == 0) throw DistError(what + ": the rendezvous store closed the connection (rank 0 exited?)");
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw DistError(what + ": " + errno_str(errno) + " (rank 0, which serves the store, exited?)");
    }
    buf += r;
    n -= size_t(r);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------- server
class TcpStore::Server {
 public:
  explicit Server(int port) {
    listen_fd_ = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    bool v6 = listen_fd_ >= 0;
    if (!v6) listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) throw DistError("rendezvous store: socket() failed: " + errno_str(errno));
    int one = 1, zero = 0;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc;
    if (v6) {
      ::setsockopt(listen_fd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));  // IPv4 too
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(uint16_t(port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(uint16_t(port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    }
    if (rc != 0 || ::listen(listen_fd_, 1024) != 0) {
      const int e = errno;
      ::close(listen_fd_);
      std::ostringstream s;
      s << "rank 0 cannot serve the rendezvous store on port " << port << ": " << errno_str(e);
      if (e == EADDRINUSE)
        s << " (another process listens there: pick a free MASTER_PORT; under torchrun, whose agent "
             "already serves MASTER_PORT, gpt2core uses MASTER_PORT+1 or GPT2CORE_STORE_PORT)";
      throw DistError(s.str());
    }
    if (::pipe2(wake_, O_CLOEXEC) != 0) {
      ::close(listen_fd_);
      throw DistError("rendezvous store: pipe() failed: " + errno_str(errno));
    }
    thread_ = std::thread([this] { loop(); });
  }

  ~Server() {
    char c = 'q';
    ssize_t ignored = ::write(wake_[1], &c, 1);
    (void)ignored;
    if (thread_.joinable()) thread_.join();
    for (auto& kv : clients_) ::close(kv.first);
    ::close(listen_fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

 private:
  void loop() {
    std::vector<pollfd> fds;
    char chunk[65536];
    for (;;) {
      fds.clear();
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      for (auto& kv : clients_) fds.push_back({kv.first, POLLIN, 0});
      int rc = ::poll(fds.data(), fds.size(), -1);
      if (rc < 0) {
        if (errno == EINTR) continue;
        return;  // nothing sensible to do: clients will time out with a clear message
      }
      if (fds[0].revents) return;
      if (fds[1].revents & POLLIN) {
        int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0) {
          int one = 1;
          ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          clients_[c];
        }
      }
      for (size_t i = 2; i < fds.size(); i++) {
        if (!fds[i].revents) continue;
        const int fd = fds[i].fd;
        ssize_t r = ::recv(fd, chunk, sizeof(chunk), 0);
        if (r <= 0) {
          if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
          ::close(fd);
          clients_.erase(fd);
          continue;
        }
        auto& buf = clients_[fd];
        buf.insert(buf.end(), chunk, chunk + r);
        if (!serve(fd, buf)) {
          ::close(fd);
          clients_.erase(fd);
        }
      }
    }
  }

  // Answers every complete request in buf; false on a malformed request or a dead client.
  bool serve(int fd, std::vector<char>& buf) {
    size_t pos = 0;
    for (;;) {
      const size_t avail = buf.size() - pos;
      if (avail < 5) break;
      const char op = buf[pos];
      const uint32_t klen = get_u32(&buf[pos + 1]);
      if (avail < 5 + size_t(klen)) break;
      std::string key(&buf[pos + 5], klen);
      std::vector<char> reply;
      if (op == 'S') {
        if (avail < 9 + size_t(klen)) break;
        const uint32_t vlen = get_u32(&buf[pos + 5 + klen]);
        if (avail < 9 + size_t(klen) + vlen) break;
        const char* v = &buf[pos + 9 + klen];
        kv_[key].assign(v, v + vlen);
        reply.push_back('k');
        pos += 9 + size_t(klen) + vlen;
      } else if (op == 'G') {
        auto it = kv_.find(key);
        if (it == kv_.end()) {
          reply.push_back('n');
        } else {
          reply.push_back('k');
          put_u32(reply, uint32_t(it->second.size()));
          reply.insert(reply.end(), it->second.begin(), it->second.end());
        }
        pos += 5 + size_t(klen);
      } else {
        return false;
      }
      if (!write_all(fd, reply.data(), reply.size())) return false;
    }
    buf.erase(buf.begin(), buf.begin() + long(pos));
    return true;
  }

  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::map<int, std::vector<char>> clients_;  // fd -> unparsed input
  std::map<std::string, std::vector<char>> kv_;
  std::thread thread_;
};

// ------------------------------------------------------------------------------------------- client
TcpStore::TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout)
    : host_(host), port_(port), timeout_(timeout) {
  if (port <= 0 || port > 65535) throw DistError("rendezvous store: port " + std::to_string(port) + " is not in 1..65535");
  if (serve) server_ = new Server(port);
  const auto deadline = Clock::now() + timeout;
  std::string last_error = "no attempt";
  while (fd_ < 0) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai != 0) {
      last_error = std::string("cannot resolve ") + host + ": " + gai_strerror(gai);
    } else {
      for (addrinfo* a = res; a && fd_ < 0; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          fd_ = fd;
        } else {
          last_error = errno_str(errno);
          ::close(fd);
        }
      }
      ::freeaddrinfo(res);
    }
    if (fd_ >= 0) break;
    if (Clock::now() >= deadline) {
      delete server_;
      server_ = nullptr;
      std::ostringstream s;
      s << "could not reach the rendezvous store at " << endpoint(host, port) << " within "
        << timeout.count() / 1000.0 << " s (" << last_error << "); rank 0 serves it: is rank 0 running, "
        << "and do MASTER_ADDR/MASTER_PORT name its host and a free port?";
      throw DistError(s.str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  delete server_;
}

void TcpStore::request(char op, const std::string& key, const std::vector<char>* value, char* status,
                       std::vector<char>* reply) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what = "rendezvous store " + endpoint(host_, port_) + " (key '" + key + "')";
  std::vector<char> msg;
  msg.push_back(op);
  put_u32(msg, uint32_t(key.size()));
  msg.insert(msg.end(), key.begin(), key.end());
  if (value) {
    put_u32(msg, uint32_t(value->size()));
    msg.insert(msg.end(), value->begin(), value->end());
  }
  if (!write_all(fd_, msg.data(), msg.size()))
    throw DistError(what + ": " + errno_str(errno) + " (rank 0, which serves the store, exited?)");
  const auto deadline = Clock::now() + timeout_;
  read_exact(fd_, status, 1, deadline, what);
  if (*status == 'k' && reply) {
    char len[4];
    read_exact(fd_, len, 4, deadline, what);
    reply->resize(get_u32(len));
    if (!reply->empty()) read_exact(fd_, reply->data(), reply->size(), deadline, what);
  }
}

void TcpStore::set(const std::string& key, const std::vector<char>& value) {
  char st = 0;
  request('S', key, &value, &st, nullptr);
}

bool TcpStore::try_get(const std::string& key, std::vector<char>* value) {
  char st = 0;
  std::vector<char> v;
  request('G', key, nullptr, &st, &v);
  if (st != 'k') return false;
  if (value) *value = std::move(v);
  return true;
}

std::vector<std::string> TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::vector<std::string> missing = keys;
  auto pause = std::chrono::milliseconds(2);
  for (;;) {
    std::vector<std::string> still;
    for (const auto& k : missing)
      if (!try_get(k, nullptr)) still.push_back(k);
    missing.swap(still);
    if (missing.empty() || Clock::now() >= deadline) return missing;
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::milliseconds(50)) pause *= 2;
  }
}

std::vector<char> TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  auto missing = wait({key}, timeout);
  std::vector<char> v;
  if (!missing.empty() || !try_get(key, &v)) {
    std::ostringstream s;
    s << "rendezvous store " << endpoint(host_, port_) << ": key '" << key << "' did not appear within "
      << timeout.count() / 1000.0 << " s";
    throw DistError(s.str());
  }
  return v;
}

}  // namespace gpt2::dist
