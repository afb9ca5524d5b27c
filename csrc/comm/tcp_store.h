// A small key-value store over TCP for the rendezvous of a process group (where rank 0 publishes what
// the others need: Gloo's transport addresses, NCCL's unique id). Rank 0 serves it from a background
// thread on `port` (all interfaces); every rank, rank 0 included, is a client of host:port.
//
// Wire format (one request, one reply, integers little-endian as on every platform we build for):
//   SET   'S' u32 klen key u32 vlen value  ->  'k'
//   GET   'G' u32 klen key                 ->  'k' u32 vlen value   |  'n' (no such key yet)
// Waiting for keys polls GET; only rendezvous uses the store, so this is not on any hot path.
#pragma once
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace gpt2::dist {

class TcpStore {
 public:
  // Connects to host:port, retrying until `timeout` while the server is not up yet. With serve=true
  // this process first starts the server (throws DistError when the port cannot be bound).
  TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::vector<char>& value);
  // Waits up to `timeout` for the key; throws DistError naming it on timeout.
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout);
  // Waits up to `timeout` for all keys; returns the ones still missing (empty: all there).
  std::vector<std::string> wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  bool try_get(const std::string& key, std::vector<char>* value);

  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  class Server;
  void request(char op, const std::string& key, const std::vector<char>* value, char* status,
               std::vector<char>* reply);

  std::string host_;
  int port_;
  std::chrono::milliseconds timeout_;
  int fd_ = -1;
  std::mutex mu_;
  Server* server_ = nullptr;
};

}  // namespace gpt2::dist
