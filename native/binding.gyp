{
  "targets": [
    {
      "target_name": "handoff_native",
      "sources": [
        "src/addon.cc",
        "src/agent.cc",
        "src/common.cc",
        "src/nixl_loader.cc",
        "src/poller.cc",
        "src/shm.cc"
      ],
      "dependencies": ["<!(node -p \"require('node-addon-api').targets\"):node_addon_api_except"],
      "defines": ["NAPI_VERSION=8"],
      "cflags_cc": ["-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter"],
      "libraries": ["-ldl", "-lrt", "-lpthread"]
    }
  ]
}
