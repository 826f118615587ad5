"""blockpool"""
